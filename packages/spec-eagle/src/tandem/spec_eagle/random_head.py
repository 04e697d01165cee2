"""Write a randomly initialised draft head in the public EAGLE / EAGLE-3 format.

A random head proposes poor drafts, so almost nothing is accepted, but every output is
still exactly the target's: that is what the tests check with it, and what lets anyone
try speculative decoding against any target before training a head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.scheduler.models import ModelConfig


def write_random_head(
    target_path: str | Path,
    folder: str | Path,
    *,
    algorithm: str = "EAGLE3",
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    aux_layers: tuple[int, int, int] | None = None,
    seed: int = 0,
    std: float = 0.05,
) -> Path:
    """Create ``folder`` with ``config.json`` and ``model.safetensors`` for a head that
    fits the target at ``target_path``. EAGLE-3 heads get a draft vocabulary of the
    ``draft_vocab_size`` lowest target ids (all of them by default) with its ``d2t`` /
    ``t2d`` maps; ``aux_layers`` goes into ``eagle_config`` when given."""
    algorithm = algorithm.upper()
    if algorithm not in ("EAGLE", "EAGLE3"):
        raise ValueError(f"algorithm must be EAGLE or EAGLE3, got {algorithm!r}")
    target = ModelConfig.from_pretrained(target_path)
    h, heads, kv_heads = target.hidden_size, target.num_attention_heads, target.num_key_value_heads
    hd, inner, vocab = target.head_dim, target.intermediate_size, target.vocab_size
    draft_vocab = draft_vocab_size or vocab
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    eagle3 = algorithm == "EAGLE3"
    tensors: dict[str, torch.Tensor] = {"fc.weight": normal(h, (3 if eagle3 else 2) * h)}
    for i in range(num_layers):
        prefix = "midlayer." if eagle3 and num_layers == 1 else f"layers.{i}."
        width = 2 * h if eagle3 and i == 0 else h
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(heads * hd, width),
            prefix + "self_attn.k_proj.weight": normal(kv_heads * hd, width),
            prefix + "self_attn.v_proj.weight": normal(kv_heads * hd, width),
            prefix + "self_attn.o_proj.weight": normal(h, heads * hd),
            prefix + "post_attention_layernorm.weight": torch.ones(h),
            prefix + "mlp.gate_proj.weight": normal(inner, h),
            prefix + "mlp.up_proj.weight": normal(inner, h),
            prefix + "mlp.down_proj.weight": normal(h, inner),
        }
        if i > 0 or eagle3:
            tensors[prefix + "input_layernorm.weight"] = torch.ones(h)
        if eagle3 and i == 0:
            tensors[prefix + "hidden_norm.weight"] = torch.ones(h)
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "intermediate_size": inner,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if eagle3:
        ids = torch.arange(draft_vocab)
        tensors["norm.weight"] = torch.ones(h)
        tensors["lm_head.weight"] = normal(draft_vocab, h)
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)  # draft id d is target d
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        config["draft_vocab_size"] = draft_vocab
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", "utf-8")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
