"""A checkpoint's architecture, read once from its ``config.json`` into one typed value.

Hugging Face configs differ by family and by the transformers version that wrote them
(``rope_theta`` at the top level or inside ``rope_parameters``, ``torch_dtype`` or
``dtype``, keys a family implies but never writes). ``ModelConfig`` settles all of that
here so the model, the weight loader and the memory planner read plain fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

# Per-family facts the config does not always say: Qwen2 always has q/k/v bias (and no
# o_proj bias) whatever ``attention_bias`` says; Qwen3 always normalizes q and k per head.
LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
MISTRAL = "MistralForCausalLM"

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (LLAMA, QWEN2, QWEN3, MISTRAL)

# Configs saved from a bare ``XConfig`` (no model) carry ``model_type`` but no
# ``architectures``; tiny test checkpoints are often made that way.
_MODEL_TYPE_TO_ARCHITECTURE: Mapping[str, str] = MappingProxyType(
    {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL}
)

# What each family's transformers config class defaults to when a key is absent.
_DEFAULT_MAX_POSITIONS: Mapping[str, int] = MappingProxyType(
    {LLAMA: 2048, QWEN2: 32768, QWEN3: 32768, MISTRAL: 4096 * 32}
)
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one Llama-family checkpoint.

    Attributes:
        architecture: one of ``SUPPORTED_ARCHITECTURES``.
        head_dim: per-head size; explicit in Qwen3 (where ``heads * head_dim`` need not
            equal ``hidden_size``), else ``hidden_size // num_attention_heads``.
        rope_theta: the rotary base.
        rope_scaling: the scaling parameters with a ``rope_type`` key (``"llama3"``, ...),
            or None for plain rotary embeddings. Validated when the model is built.
        attention_bias: q/k/v projections have a bias.
        attention_out_bias: o_proj has a bias (Llama/Qwen3 with ``attention_bias``; never
            Qwen2, whose bias is on q/k/v only).
        mlp_bias: gate/up/down projections have a bias (Llama's ``mlp_bias``).
        qk_norm: RMSNorm over each head of q and k before rotary (Qwen3).
        eos_token_id: every end-of-sequence id (configs give an int, a list, or null).
        dtype: the dtype the checkpoint was saved in (``"bfloat16"``, ...), if recorded.
        sliding_window: the checkpoint's sliding attention window, if it uses one.
            Recorded so callers can refuse or cap contexts longer than it; the model
            itself attends over the whole context.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = _DEFAULT_RMS_NORM_EPS
    rope_theta: float = _DEFAULT_ROPE_THETA
    # A dict cannot be hashed; leaving it out of the hash keeps ModelConfig usable as a key.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _check_shapes(self)

    @property
    def q_size(self) -> int:
        """Width of the q projection's output (all query heads)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the k (or v) projection's output (all KV heads)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def matmul_weights_per_token(self) -> int:
        """Weights a decode token multiplies by: every layer's projections and the head
        (the embedding is a lookup). Twice this is its matmul FLOPs."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * self.intermediate_size
        return self.num_hidden_layers * (attention + mlp) + h * self.vocab_size

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Read a parsed Hugging Face ``config.json`` (either transformers 4 or 5 form)."""
        arch = _architecture(d)
        heads = _required_int(d, "num_attention_heads")
        hidden = _required_int(d, "hidden_size")
        rope_theta, rope_scaling = _rope(d)
        attention_bias = bool(d.get("attention_bias", False))
        _check_activation(d)
        return cls(
            architecture=arch,
            vocab_size=_required_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(d, "intermediate_size"),
            num_hidden_layers=_required_int(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(
                d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]
            ),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias or arch == QWEN2,
            attention_out_bias=attention_bias and arch in (LLAMA, QWEN3),
            mlp_bias=bool(d.get("mlp_bias", False)) and arch == LLAMA,
            qk_norm=arch == QWEN3,
            eos_token_id=_token_ids(d.get("eos_token_id")),
            bos_token_id=_optional_token_id(d.get("bos_token_id")),
            dtype=_dtype_name(d),
            sliding_window=_sliding_window(d, arch),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint folder (or the file itself)."""
        p = Path(path)
        file = p if p.is_file() else p / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        with file.open(encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


def _architecture(d: Mapping[str, Any]) -> str:
    """The first supported entry of ``architectures`` (else the one ``model_type`` implies)."""
    names = list(d.get("architectures") or [])
    if not names and d.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
        return _MODEL_TYPE_TO_ARCHITECTURE[d["model_type"]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    given = ", ".join(map(str, names)) or f"model_type={d.get('model_type')!r}"
    raise ValueError(
        f"unsupported architecture {given}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _required_int(d: Mapping[str, Any], key: str) -> int:
    """A key the architecture cannot be guessed without; its absence is the config's fault."""
    if d.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return int(d[key])


def _rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or the older top-level
    ``rope_theta`` + ``rope_scaling`` (whose type key was once ``type``)."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
        scaling = d.get("rope_scaling")
    return float(theta), _normalized_scaling(scaling)


def _normalized_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Scaling parameters with their type under ``rope_type``; None for plain rotary."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if out["rope_type"] == "default" and set(out) <= {"rope_type", "partial_rotary_factor"}:
        return None if out.get("partial_rotary_factor", 1.0) == 1.0 else out
    return out


def _check_activation(d: Mapping[str, Any]) -> None:
    """The MLP is SwiGLU; a different activation would run silently wrong."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is supported")


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _optional_token_id(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return int(value)


def _dtype_name(d: Mapping[str, Any]) -> str | None:
    """transformers 5 writes ``dtype``, 4 wrote ``torch_dtype`` (sometimes ``torch.x``)."""
    value = d.get("dtype") or d.get("torch_dtype")
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def _sliding_window(d: Mapping[str, Any], arch: str) -> int | None:
    """Mistral applies ``sliding_window`` whenever set; Qwen only with ``use_sliding_window``."""
    window = d.get("sliding_window")
    if window is None or arch == LLAMA:
        return None
    if arch in (QWEN2, QWEN3) and not d.get("use_sliding_window", False):
        return None
    return int(window)


def _check_shapes(c: ModelConfig) -> None:
    """Reject head counts the attention layout cannot express."""
    if c.num_attention_heads <= 0 or c.num_key_value_heads <= 0:
        raise ValueError("num_attention_heads and num_key_value_heads must be positive")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({c.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({c.num_key_value_heads})"
        )
    if c.head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {c.head_dim}")
