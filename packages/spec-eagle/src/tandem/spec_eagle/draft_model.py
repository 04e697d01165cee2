"""EAGLE and EAGLE-3 draft heads over packed tokens, and their loader.

The draft at position ``p`` reads token ``p + 1`` and a hidden state for position
``p`` (the target's features, or the draft's own output one step earlier) and predicts
token ``p + 2``. Parameter names are the public checkpoints', so loading is a copy by
name. The draft shares the target's token embedding (unless the head ships its own)
and, for EAGLE, the target's ``lm_head``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.models import CausalLM, RotaryEmbedding, apply_rotary
from tandem.scheduler.models.decoder import MLP, RMSNorm
from tandem.scheduler.models.packing import PackedLinear
from tandem.scheduler.models.quantized import (
    pack_quantized,
    quant_kernel,
    quantize_layers_int8,
)
from tandem.spec_eagle.draft_config import DraftConfig


class DraftAttention(nn.Module):
    """Self-attention whose projections read ``in_features`` (2 x hidden in an EAGLE-3
    first layer); the KV cache and the mask belong to the attention backend."""

    def __init__(self, config: DraftConfig, layer_id: int, in_features: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_features, q_size, bias=bias)
        self.k_proj = nn.Linear(in_features, kv_size, bias=bias)
        self.v_proj = nn.Linear(in_features, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.qkv: PackedLinear | None = None  # q, k and v as one product (``quantize_int8``)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out: torch.Tensor = self.o_proj(
            attn.forward(self.layer_id, q, k, v, scale=self.head_dim**-0.5)
        )
        return out


class DraftLayer(nn.Module):
    """One pre-norm decoder layer of a draft head.

    ``fuse_embedding``: the EAGLE-3 first layer, whose attention reads
    ``[input_layernorm(embedding); hidden_norm(hidden)]``. ``input_norm=False``: the
    EAGLE first layer, which attends over ``fc``'s output un-normed.
    """

    def __init__(
        self, config: DraftConfig, layer_id: int, *, fuse_embedding: bool, input_norm: bool
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fuse_embedding = fuse_embedding
        self.input_layernorm = RMSNorm(h, eps) if input_norm or fuse_embedding else None
        self.hidden_norm = RMSNorm(h, eps) if fuse_embedding else None
        self.self_attn = DraftAttention(config, layer_id, 2 * h if fuse_embedding else h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(_mlp_config(config))

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        if self.fuse_embedding:
            assert self.input_layernorm is not None
            assert self.hidden_norm is not None
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        elif self.input_layernorm is not None:
            x = self.input_layernorm(hidden)
        else:
            x = hidden
        hidden = hidden + self.self_attn(x, cos, sin, attn)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class EagleDraftModel(nn.Module):
    """An EAGLE or EAGLE-3 head (see ``draft_config`` for the two layouts)."""

    def __init__(self, config: DraftConfig, target: CausalLM) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        eagle3 = config.algorithm == "EAGLE3"
        self.eagle3 = eagle3
        self.fc = nn.Linear((3 if eagle3 else 2) * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList(
            DraftLayer(config, i, fuse_embedding=eagle3 and i == 0, input_norm=i > 0)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps) if eagle3 else None
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False) if eagle3 else None
        self.embed_tokens: nn.Embedding | None = None  # only when the head ships one
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # Not submodules: the target's weights are not the head's to load or move.
        self._target = (target.model.embed_tokens, target.lm_head)

    @property
    def max_position(self) -> int:
        return self.config.max_position_embeddings - 1

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """``[T]`` next tokens, ``[T, F]`` hidden inputs, ``[T]`` positions ->
        ``[T, hidden]`` outputs (what the next draft step reads as its hidden).

        ``F`` is 3 x hidden for EAGLE-3 target features (``fc`` folds them) and
        hidden for the draft's own outputs."""
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0]
        embeds = embed(token_ids)
        h = self.config.hidden_size
        if self.eagle3:
            x = self.fc(hidden) if hidden.shape[-1] != h else hidden
        else:
            x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(x, embeds, cos, sin, attn)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, draft_vocab]`` float32 logits."""
        if self.lm_head is not None and self.norm is not None:
            return self.lm_head(self.norm(hidden)).float()
        head = self.lm_head if self.lm_head is not None else self._target[1]
        return head(hidden).float()

    @torch.no_grad()
    def quantize_int8(self) -> bool:
        """On the CPU, hold every projection of the head in weight-only int8 (one scale
        per 32 inputs of a row, x in two 8-bit parts: ``models.quantized``), q/k/v and
        gate/up each one product. A draft step reads a head's weights for one or a few
        tokens a request, so its time is their bytes: a quarter of float32's. Only the
        drafts change, never what is committed (the target verifies every token).
        Returns whether it did (it needs tandem's CPU kernels loaded, and a head not
        quantized yet)."""
        if not isinstance(self.fc, nn.Linear) or self.fc.weight.device.type != "cpu":
            return False
        if not quant_kernel():
            return False
        quantize_layers_int8(self, every_linear=True)
        for layer in self.layers:
            attn = layer.self_attn
            attn.qkv = pack_quantized((attn.q_proj, attn.k_proj, attn.v_proj))
            layer.mlp.pack(column_major=False, onednn=False, forward_threads=1)
        return True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (``target = draft + d2t[draft]``)."""
        if not self.eagle3:
            return draft_ids
        d2t: torch.Tensor = self.d2t
        return draft_ids + d2t[draft_ids]


@dataclasses.dataclass(frozen=True)
class _MLPShape:
    """The three fields ``MLP`` reads of a model config."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


def _mlp_config(config: DraftConfig) -> Any:
    return _MLPShape(config.hidden_size, config.intermediate_size)


# -- loading ---------------------------------------------------------------------------------


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head: ``*.safetensors`` (one file or shards), else
    ``pytorch_model.bin`` (many public EAGLE heads ship that)."""
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensors[name] = f.get_tensor(name)
        return tensors
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        loaded = torch.load(binary, map_location="cpu", weights_only=True)
        return {str(k): v for k, v in loaded.items()}
    raise FileNotFoundError(f"draft checkpoint {folder} has no *.safetensors or pytorch_model.bin")


def _normalize_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept the layouts public heads use: a ``model.`` prefix, and an EAGLE-3 first
    layer called ``midlayer`` or ``layers.0``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        out[name] = tensor
    return out


_OPTIONAL = ("t2d", "embed_tokens.weight", "layers.0.input_layernorm.weight", "fc.bias")


def load_draft_model(
    folder: str | Path,
    target: CausalLM,
    *,
    algorithm: str | None,
    dtype: torch.dtype,
    device: torch.device,
) -> EagleDraftModel:
    """Build the head described by ``folder/config.json`` and copy its weights.

    Missing or mis-shaped tensors are one error listing them all."""
    path = Path(folder)
    config = DraftConfig.from_pretrained(path, target.config, algorithm=algorithm)
    tensors = _normalize_names(read_checkpoint(path))
    config = dataclasses.replace(config, fc_bias="fc.bias" in tensors)
    if config.algorithm == "EAGLE3" and "d2t" not in tensors and "lm_head.weight" in tensors:
        rows = tensors["lm_head.weight"].shape[0]
        if rows != config.vocab_size:
            raise ValueError("an EAGLE-3 head with a reduced vocabulary needs its d2t map")
    if "lm_head.weight" in tensors:
        config = dataclasses.replace(config, draft_vocab_size=tensors["lm_head.weight"].shape[0])
    model = EagleDraftModel(config, target)
    if config.algorithm == "EAGLE" and "lm_head.weight" in tensors:
        model.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
    if "embed_tokens.weight" in tensors:
        model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    expected = dict(model.state_dict())
    problems = []
    for name, param in expected.items():
        if name not in tensors:
            if name == "d2t":
                continue  # a full-vocabulary head: the identity map
            problems.append(f"missing {name} {tuple(param.shape)}")
        elif tuple(tensors[name].shape) != tuple(param.shape):
            problems.append(
                f"{name}: checkpoint {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected) - set(_OPTIONAL))
    problems += [f"unexpected {name}" for name in unexpected]
    if problems:
        raise ValueError(f"draft checkpoint {path} does not fit its config: " + "; ".join(problems))
    with torch.no_grad():
        for name, param in expected.items():
            if name in tensors:
                param.copy_(tensors[name].to(param.dtype))
    model.to(device=device, dtype=dtype)
    model.d2t = model.d2t.to(device=device, dtype=torch.int64)
    model.eval().requires_grad_(False)
    return model
