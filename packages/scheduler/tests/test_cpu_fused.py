"""tandem's fused CPU ops (``torch.ops.tandem.rms_norm``, ``silu_mul`` and ``rotary``,
built from ``kernels/cpu_fused.cpp``): each against the torch formula it replaces, in
float32 and bfloat16, on the strided views the model hands them; the inputs they refuse;
and an engine's tokens with them
equal to its tokens without, in both loops, through the decode trace. A model running
them against transformers' logits is in ``test_models``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.scheduler import Engine
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models.decoder import RMSNorm, _rotate
from tandem.scheduler.models.rope import RotaryEmbedding
from tandem.scheduler.models.tiny import cache_root

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal up to the order of a sum or one fused multiply-add; bfloat16: a
    rare element one rounding step away (where that float32 difference crosses a
    bfloat16 rounding boundary), no more."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    if got.dtype == torch.float32:
        assert (diff <= 1e-6 + 1e-6 * want.abs()).all()
    else:
        assert (diff <= want.float().abs() * 2**-7).all()
        assert (got != want).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rms_norm_equals_the_formula(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x = (torch.randn(tokens, 160, generator=gen) * 3).to(dtype)[:, 32:128]  # rows strided
    want = norm(x)
    got = torch.ops.tandem.rms_norm(x, norm.weight, 1e-6)
    _close(got, want)
    # Through the module, on a [T, heads, D] view as q/k norms see it.
    heads = x[:, :64].view(tokens, 4, 16)
    head_norm = RMSNorm(16, 1e-6).to(dtype)
    want = head_norm(heads)
    head_norm.fused = True
    _close(head_norm(heads), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_equals_the_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    # A fused gate/up projection's output: two halves of each row. Values up to +-100
    # reach exp's clamps.
    gate_up = (torch.randn(37, 2 * 200, generator=gen) * 12).to(dtype)
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0]).to(dtype)
    gate, up = gate_up.split(200, dim=-1)
    got = torch.ops.tandem.silu_mul(gate, up)
    assert got.is_contiguous()
    _close(got, F.silu(gate).mul_(up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_equals_the_formula(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 23, 6, 2
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None)
    cos, sin = rope(torch.randint(0, 4096, (tokens,), generator=gen))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # views of the projection
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    for x in (q, k):
        _close(_rotate(x, cos, sin, fused=True), _rotate(x, cos, sin))


def test_the_ops_refuse_what_they_do_not_take() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16"):
        torch.ops.tandem.rms_norm(x.half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(RuntimeError, match="does not match x"):
        torch.ops.tandem.rms_norm(x, torch.ones(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.tandem.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="gate and up"):
        torch.ops.tandem.silu_mul(x, torch.randn(4, 9))
    table = torch.randn(4, 1, 8)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.tandem.rotary(x.view(4, 1, 8), table.bfloat16(), table)
    with pytest.raises(RuntimeError, match="D even"):
        torch.ops.tandem.rotary(torch.randn(4, 1, 7), table, table)


def test_a_fused_module_keeps_the_formula_for_what_the_ops_do_not_take() -> None:
    norm = RMSNorm(8, 1e-6).half()
    norm.fused = True
    x = torch.randn(3, 8).half()
    assert torch.equal(norm(x), RMSNorm(8, 1e-6).half()(x))


INPUTS = [[(11 * i + 5 * j) % 250 + 4 for j in range(3 + 13 * i)] for i in range(6)]
MAX_NEW = [4, 60, 17, 120, 8, 33]


def _tokens(fused: bool, overlap: bool) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path="tandem-tiny",
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        disable_cpu_fused_ops=not fused,
        disable_overlap_schedule=not overlap,
    )
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW]
    try:
        results = engine.generate(input_ids=INPUTS, sampling_params=params)
        return [r["output_ids"] for r in results], engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_engine_tokens_with_the_fused_ops_equal_tokens_without(overlap: bool) -> None:
    fused, engine = _tokens(fused=True, overlap=overlap)
    plain, reference = _tokens(fused=False, overlap=overlap)
    norms = [m for m in engine.scheduler.runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms
    assert all(m.fused for m in norms)
    assert not any(m.fused for m in reference.scheduler.runner.model.modules()
                   if isinstance(m, RMSNorm))  # fmt: skip
    trace = engine.scheduler.runner.decode_trace
    assert trace is not None
    assert trace.replays > 0
    assert fused == plain
    assert [len(ids) for ids in fused] == MAX_NEW
