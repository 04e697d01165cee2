"""The inference weight layout (``CausalLM.pack``): fused q/k/v and gate/up projections,
column-major weights on the CPU. The forward must stay the same function of the weights,
the parameters must keep their names and shapes, and writes into a parameter after
packing must reach what the forward reads."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from reference_models import DenseCausalAttention, tiny_model_config
from torch import nn

from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models import CausalLM, ModelConfig, load_model
from tandem.scheduler.models.packing import (
    ONEDNN_MIN_HIDDEN,
    make_column_major,
    onednn_available,
    pack_linears,
)


def _config(**overrides: Any) -> ModelConfig:
    return tiny_model_config(**{"architectures": ["LlamaForCausalLM"], **overrides})


def _unpacked_copy(model: CausalLM) -> CausalLM:
    """The same weights in a freshly built, never packed model."""
    plain = CausalLM(model.config)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


@torch.no_grad()
def _logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(ids.numel()), DenseCausalAttention([ids.numel()]))
    return model.compute_logits(hidden)


CONFIGS = {
    "llama": {},
    "llama-biases": {"attention_bias": True, "mlp_bias": True},
    "qwen3-qk-norm": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "tied": {"tie_word_embeddings": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_forward_matches_the_unpacked_model(name: str) -> None:
    model = load_model(None, _config(**CONFIGS[name]), dtype=torch.float32, device="cpu",
                       load_format="dummy")  # fmt: skip
    assert all(layer.self_attn.qkv is not None for layer in model.model.layers)
    assert all(layer.mlp.gate_up is not None for layer in model.model.layers)
    plain = _unpacked_copy(model)
    assert plain.model.layers[0].self_attn.qkv is None
    ids = torch.randint(96, (11,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), rtol=1e-5, atol=1e-5)


def test_parameters_keep_names_and_shapes_and_write_through() -> None:
    config = _config(attention_bias=True)
    model = load_model(None, config, dtype=torch.float32, device="cpu", load_format="dummy")
    shapes = {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == shapes
    attn = model.model.layers[0].self_attn
    assert attn.qkv is not None
    # On the CPU every projection is column-major; the fused one holds q, k, v in order.
    assert attn.qkv.weight.t().is_contiguous()
    assert model.lm_head.weight.t().is_contiguous()
    torch.testing.assert_close(attn.qkv.weight[: config.q_size], attn.q_proj.weight)
    ids = torch.arange(7)
    model.pack(onednn=True)  # as a model of a larger hidden size is packed on the CPU
    before = _logits(model, ids)
    with torch.no_grad():
        attn.v_proj.weight.mul_(2.0)  # e.g. a weight update after loading
        attn.k_proj.bias.add_(1.0)
    model.pack(onednn=True)  # the stacked weights saw the write; the copies are redone
    after = _logits(model, ids)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, _logits(_unpacked_copy(model), ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("forward_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_projections_multiply_by_a_onednn_copy_at_every_batch(
    dtype: torch.dtype, forward_threads: int
) -> None:
    model = load_model(None, _config(), dtype=dtype, device="cpu", load_format="dummy")
    assert model.config.hidden_size < ONEDNN_MIN_HIDDEN
    assert model.head is None, "a tiny model keeps MKL's products"
    model.pack(onednn=True, forward_threads=forward_threads)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    if onednn_available(dtype):
        packed = [attn.qkv, attn.o, mlp.gate_up, mlp.down, model.head]
        assert all(p is not None and p.onednn is not None for p in packed)
        assert len(model.packed_weights()) == 4 * len(model.model.layers)
        # A float32 token on a one-thread forward takes MKL's product on the column-major
        # weight; every other batch takes oneDNN's.
        single = 1 if dtype == torch.float32 and forward_threads == 1 else 0
        assert {p.dense_up_to for p in packed if p is not None} == {single}
    else:
        # A CPU whose oneDNN cannot multiply this dtype (bfloat16 without AVX-512 BW/VL/DQ
        # or AVX-NE-CONVERT): no copies, which would fail to build, and the fused
        # projections keep the column-major weights, marked for panels (with_panels).
        packed = [attn.qkv, attn.o, mlp.gate_up, mlp.down, model.head]
        assert model.packed_weights() == ()
        assert all(p is not None and p.onednn is None and p.blocked for p in packed)
    plain = _unpacked_copy(model)
    # Both paths agree with the unpacked model.
    for n in (1, 2, 9):
        ids = torch.randint(96, (n,), generator=torch.Generator().manual_seed(n))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), rtol=tol, atol=tol)


def test_onednn_is_available_for_the_dtypes_this_cpu_multiplies() -> None:
    assert onednn_available()  # every CPU build of torch has it for float32
    assert onednn_available(torch.float32)
    assert onednn_available(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert onednn_available(torch.float16) == torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert not onednn_available(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packing_warns_where_onednn_cannot_multiply_the_dtype(
    dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(None, _config(), dtype=dtype, device="cpu", load_format="dummy")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tandem.scheduler.models.decoder"):
        model.pack()
    warned = [m for r in caplog.records if "oneDNN cannot multiply" in (m := r.getMessage())]
    # Not where tandem's product takes bfloat16 in oneDNN's place (AVX2).
    panels = dtype == torch.bfloat16 and cpu_build.bf16_panels()
    assert bool(warned) == (not onednn_available(dtype) and not panels)
    if warned:
        assert str(dtype).removeprefix("torch.") in warned[0]
        assert "--dtype float32" in warned[0]


def test_a_tied_head_keeps_the_embedding_rows() -> None:
    model = load_model(None, _config(tie_word_embeddings=True), dtype=torch.float32,
                       device="cpu", load_format="dummy")  # fmt: skip
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.is_contiguous()


def test_row_major_packing_keeps_row_major_storage() -> None:
    model = CausalLM(_config()).eval()
    model.pack(column_major=False)
    attn = model.model.layers[0].self_attn
    assert attn.qkv is not None
    assert attn.qkv.weight.is_contiguous()
    assert attn.o_proj.weight.is_contiguous()


def test_pack_linears_refuses_layers_that_do_not_stack() -> None:
    with pytest.raises(ValueError, match="inputs of different sizes"):
        pack_linears([nn.Linear(4, 3), nn.Linear(5, 3)], column_major=True)
    with pytest.raises(ValueError, match="some layers have a bias"):
        pack_linears([nn.Linear(4, 3), nn.Linear(4, 3, bias=False)], column_major=False)


def test_make_column_major_keeps_values() -> None:
    linear = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    with torch.no_grad():
        expected = linear(x)
        make_column_major(linear)
        assert linear.weight.t().is_contiguous()
        torch.testing.assert_close(linear(x), expected)
