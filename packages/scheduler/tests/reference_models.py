"""Tiny random Hugging Face checkpoints of each supported family, written with
transformers' own ``save_pretrained`` so the tests read exactly what users' folders hold.

Weights are redrawn from a seeded generator at a larger scale than transformers' init
(std 0.02 would leave logits nearly uniform, hiding bugs), and norm weights are moved
away from one so that a skipped or misplaced norm changes the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tandem.scheduler.attention.base import AttentionBackend
from tandem.scheduler.forward_batch import ForwardBatch
from tandem.scheduler.models import ModelConfig

VOCAB = 320
HIDDEN = 64
LAYERS = 2
INTERMEDIATE = 112
HEADS = 4
MAX_POSITIONS = 256
# Small enough that the prompts' positions span all three llama3 frequency bands.
LLAMA3_ORIGINAL_CONTEXT = 32

FAMILIES: tuple[str, ...] = ("llama", "llama3", "qwen2", "qwen3", "mistral")


def _common(kv_ratio: int, tied: bool) -> dict[str, Any]:
    assert HEADS % kv_ratio == 0, kv_ratio
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS // kv_ratio,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def llama_config(
    *, kv_ratio: int = 1, tied: bool = False, llama3_rope: bool = False, bias: bool = False
) -> LlamaConfig:
    """Llama 2 (plain rope) or Llama 3.1 (``llama3`` scaling); ``bias`` turns on both
    ``attention_bias`` (q/k/v/o) and ``mlp_bias``."""
    extra: dict[str, Any] = {"rope_theta": 10000.0}
    if llama3_rope:
        extra = {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
            },
        }
    return LlamaConfig(**_common(kv_ratio, tied), attention_bias=bias, mlp_bias=bias, **extra)


def qwen2_config(*, kv_ratio: int = 1, tied: bool = False) -> Qwen2Config:
    return Qwen2Config(**_common(kv_ratio, tied), rope_theta=1000000.0)


def qwen3_config(*, kv_ratio: int = 1, tied: bool = False) -> Qwen3Config:
    """``head_dim`` 32 with 4 heads: ``heads * head_dim != hidden``, as in real Qwen3."""
    return Qwen3Config(**_common(kv_ratio, tied), head_dim=32, rope_theta=1000000.0)


def mistral_config(*, kv_ratio: int = 1, tied: bool = False) -> MistralConfig:
    """With Mistral 7B v0.1's 4096 sliding window, longer than any test prompt."""
    return MistralConfig(**_common(kv_ratio, tied), sliding_window=4096)


def family_config(family: str, *, kv_ratio: int = 1, tied: bool = False) -> PretrainedConfig:
    if family in ("llama", "llama3"):
        return llama_config(kv_ratio=kv_ratio, tied=tied, llama3_rope=family == "llama3")
    builders = {"qwen2": qwen2_config, "qwen3": qwen3_config, "mistral": mistral_config}
    return builders[family](kv_ratio=kv_ratio, tied=tied)


@torch.no_grad()
def randomize(model: PreTrainedModel, seed: int) -> None:
    """Redraw every parameter from ``seed``, in name order so the draw is reproducible."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name:
            param.copy_(0.5 * noise)
        else:
            param.copy_(0.1 * noise)


def save_checkpoint(
    config: PretrainedConfig,
    path: Path,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Build a random model for ``config`` and ``save_pretrained`` it into ``path``."""
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    model = model.to(dtype)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def make_llama(
    path: Path,
    *,
    seed: int,
    kv_ratio: int = 1,
    tied: bool = False,
    llama3_rope: bool = False,
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    config = llama_config(kv_ratio=kv_ratio, tied=tied, llama3_rope=llama3_rope, bias=bias)
    return save_checkpoint(config, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def make_qwen2(path: Path, *, seed: int, kv_ratio: int = 1, tied: bool = False) -> Path:
    return save_checkpoint(qwen2_config(kv_ratio=kv_ratio, tied=tied), path, seed=seed)


def make_qwen3(path: Path, *, seed: int, kv_ratio: int = 1, tied: bool = False) -> Path:
    return save_checkpoint(qwen3_config(kv_ratio=kv_ratio, tied=tied), path, seed=seed)


def make_mistral(path: Path, *, seed: int, kv_ratio: int = 1, tied: bool = False) -> Path:
    return save_checkpoint(mistral_config(kv_ratio=kv_ratio, tied=tied), path, seed=seed)


def make_family(
    family: str, path: Path, *, seed: int, kv_ratio: int = 1, tied: bool = False
) -> Path:
    """One of ``FAMILIES`` (``llama3`` is Llama with ``llama3`` rope scaling)."""
    config = family_config(family, kv_ratio=kv_ratio, tied=tied)
    return save_checkpoint(config, path, seed=seed)


def load_reference(path: Path) -> PreTrainedModel:
    """transformers' own model for a checkpoint, float32, eager attention (the plainest
    implementation, so a disagreement points at tandem, not at a fused kernel)."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """A tandem ``ModelConfig`` of a tiny Qwen3-shaped model (no checkpoint), for tests
    of config handling and of the model's own layout; ``overrides`` are HF config keys."""
    d: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
    }
    return ModelConfig.from_hf_dict({**d, **overrides})


class DenseCausalAttention(AttentionBackend):
    """Reference attention for a packed batch of fresh prompts: no KV cache, each
    request attends causally within its own segment of the ``[T]`` token layout."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def plan(self, batch: ForwardBatch) -> None:
        """Nothing to plan: the segments are fixed at construction."""

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        outputs = []
        for qs, ks, vs in zip(
            q.split(self.lengths), k.split(self.lengths), v.split(self.lengths), strict=True
        ):
            out = F.scaled_dot_product_attention(
                qs.transpose(0, 1),
                ks.transpose(0, 1).repeat_interleave(group, dim=0),
                vs.transpose(0, 1).repeat_interleave(group, dim=0),
                is_causal=True,
                scale=scale,
            )
            outputs.append(out.transpose(0, 1).reshape(qs.shape[0], -1))
        return torch.cat(outputs)
