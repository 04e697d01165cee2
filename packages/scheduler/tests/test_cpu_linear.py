"""tandem's product (``torch.ops.tandem.linear_panels``, built from
``kernels/cpu_linear.cpp`` on CPUs with AVX2 and FMA or AVX-512; bfloat16 on AVX2 and on
AVX-512 with AVX512_BF16) over
weights in panels (``packing.to_panels``): against ``F.linear`` at row counts below, at
and above its tiles and chunks, at output sizes that end mid-panel or mid-vector and,
in bfloat16, at odd input sizes; the inputs it refuses; the packed products that take
it (``packing.with_panels``) at every batch; and an engine's tokens with it equal to its
tokens without, in both loops, through the decode trace. On a CPU without AVX2 the op
does not exist and nothing takes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference_models import DenseCausalAttention, tiny_model_config

from tandem.scheduler import Engine
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models import CausalLM, load_model, packing
from tandem.scheduler.models.packing import PANEL_COLUMNS, panels_available, to_panels
from tandem.scheduler.models.tiny import cache_root, default_model_path

CAPABILITY = torch.backends.cpu.get_cpu_capability()
PANELS = CAPABILITY in ("AVX2", "AVX512")  # float32: AVX2 tiles, or AVX-512 ones
# bfloat16: AVX2 tiles over widened pairs, or AVX-512 ones with AVX512_BF16 (without it,
# oneDNN multiplies bfloat16 on AVX-512).
BF16 = CAPABILITY == "AVX2" or (CAPABILITY == "AVX512" and cpu_build.bf16_kernels())


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen)


def test_the_op_exists_exactly_on_avx2_and_up() -> None:
    assert panels_available() == PANELS
    assert panels_available(torch.bfloat16) == BF16
    assert not panels_available(torch.float16)
    assert cpu_build.panel_halves() == (CAPABILITY == "AVX2")  # the AVX2 tiles' layout


def test_bfloat16_panels_hold_pairs_of_inputs_side_by_side() -> None:
    weight = _weight(50, 5, seed=3).bfloat16()
    panels = to_panels(weight)
    assert panels.shape == (2, 3, 2 * PANEL_COLUMNS)  # 5 inputs: 3 pairs, the last half
    assert panels.is_contiguous()
    pairs = panels.view(2, 3, PANEL_COLUMNS, 2)
    for p in range(2):
        for col in range(min(PANEL_COLUMNS, 50 - p * PANEL_COLUMNS)):
            row = weight[p * PANEL_COLUMNS + col]
            assert pairs[p, :, col].flatten()[:5].equal(row)
    assert not pairs[:, 2, :, 1].any()  # the odd input's missing partner
    assert not pairs[1, :, 50 - PANEL_COLUMNS :].any()  # zero past the last row


def test_panels_hold_the_weight_columns_in_address_order() -> None:
    weight = _weight(100, 7, seed=0)
    panels = to_panels(weight, halves=False)
    assert panels.shape == (3, 7, PANEL_COLUMNS)
    assert panels.is_contiguous()
    for p in range(3):
        cols = weight.t()[:, p * PANEL_COLUMNS : (p + 1) * PANEL_COLUMNS]
        torch.testing.assert_close(panels[p, :, : cols.shape[1]], cols, rtol=0, atol=0)
    assert not panels[2, :, 100 - 2 * PANEL_COLUMNS :].any()  # zero past the last row
    assert to_panels(weight.t().contiguous().t(), halves=False).equal(panels)  # any order


def test_panels_by_halves_hold_each_half_of_the_columns_in_address_order() -> None:
    weight = _weight(100, 7, seed=0)
    half = PANEL_COLUMNS // 2
    panels = to_panels(weight, halves=True)
    assert panels.shape == (3, 2, 7, half)  # panel, half, input, column
    assert panels.is_contiguous()
    whole = to_panels(weight, halves=False)
    for p in range(3):
        for h in range(2):
            torch.testing.assert_close(
                panels[p, h], whole[p, :, h * half : (h + 1) * half], rtol=0, atol=0
            )
    assert to_panels(weight).equal(panels if cpu_build.panel_halves() else whole)


@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 5, 6, 7, 8, 9, 31, 64, 65, 96, 200])
@pytest.mark.parametrize(
    ("rows", "cols"), [(9000, 768), (1280, 768), (100, 2048), (17, 5), (1, 3), (64, 64)]
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_panels_equals_f_linear(tokens: int, rows: int, cols: int, bias: bool) -> None:
    if not PANELS:
        return  # test_the_op_exists_exactly_on_avx2_and_up checks it is absent
    if rows == 9000 and tokens > 9:
        return  # the head only ever multiplies a step's sampled rows; spare the time
    weight = _weight(rows, cols, seed=rows + cols)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, cols, generator=gen)
    b = torch.randn(rows, generator=gen) if bias else None
    got = torch.ops.tandem.linear_panels(x, to_panels(weight), b, rows)
    # float32 sums in another order: within a few units in the last place of |x| |w|.
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=2e-5 * cols**0.5)


@pytest.mark.parametrize("tokens", [0, 1, 7, 8, 9, 64, 65, 96])
@pytest.mark.parametrize(
    ("rows", "cols"), [(1280, 768), (100, 2048), (17, 5), (1, 3), (64, 64), (49, 1)]
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_bfloat16_linear_panels_equals_f_linear(
    tokens: int, rows: int, cols: int, bias: bool
) -> None:
    if not BF16:
        return  # test_the_op_exists_exactly_on_avx2_and_up checks it refuses bfloat16
    weight = _weight(rows, cols, seed=rows + cols).bfloat16()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, cols, generator=gen).bfloat16()
    b = torch.randn(rows, generator=gen).bfloat16() if bias else None
    got = torch.ops.tandem.linear_panels(x, to_panels(weight), b, rows)
    assert got.dtype == torch.bfloat16
    # float32 sums of exact products, rounded once: the float32 reference's rounding,
    # give or take one unit in bfloat16's last place where the two sums straddle it.
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-5 * cols**0.5)


def test_linear_panels_keeps_leading_dimensions_and_reads_strided_rows() -> None:
    if not PANELS:
        return
    weight = _weight(40, 24, seed=1)
    panels = to_panels(weight)
    x = torch.randn(10, 48)[:, ::2]  # rows strided
    got = torch.ops.tandem.linear_panels(x, panels, None, 40)
    torch.testing.assert_close(got, F.linear(x, weight))
    x3 = torch.randn(2, 3, 24)
    got = torch.ops.tandem.linear_panels(x3, panels, None, 40)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, F.linear(x3, weight))


def test_linear_panels_refuses_what_it_does_not_take() -> None:
    if not PANELS:
        return
    panels = to_panels(_weight(50, 4, seed=2))  # two panels: 49 to 96 outputs
    op = torch.ops.tandem.linear_panels
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="in panels of 48"):
        op(x, panels.transpose(1, 2).contiguous(), None, 50)
    with pytest.raises(RuntimeError, match="in panels of 48"):
        op(x, panels.transpose(0, 1), None, 50)  # not contiguous
    other = to_panels(_weight(50, 4, seed=2), halves=not cpu_build.panel_halves())
    with pytest.raises(RuntimeError, match="in panels of 48"):
        op(x, other, None, 50)  # the other build's layout
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16"):
        op(x.half(), panels.half(), None, 50)
    with pytest.raises(RuntimeError, match="x and weight alike"):
        op(x.bfloat16(), panels, None, 50)
    with pytest.raises(RuntimeError, match="x has 3 features"):
        op(torch.randn(1, 3), panels, None, 50)
    with pytest.raises(RuntimeError, match="the bias"):
        op(x, panels, torch.randn(7), 50)
    with pytest.raises(RuntimeError, match="hold 49 to 96 output features, not 48"):
        op(x, panels, None, 48)
    with pytest.raises(RuntimeError, match="not 97"):
        op(x, panels, None, 97)
    with pytest.raises(RuntimeError, match="an empty weight"):
        op(torch.randn(1, 0), to_panels(torch.empty(1, 0)), None, 1)
    if not BF16:
        with pytest.raises(RuntimeError, match="bfloat16 needs AVX512_BF16"):
            op(x.bfloat16(), to_panels(_weight(50, 4, seed=2).bfloat16()), None, 50)
        return
    pairs = to_panels(_weight(50, 4, seed=2).bfloat16())
    with pytest.raises(RuntimeError, match="in panels of 48"):
        op(x.bfloat16(), panels.bfloat16(), None, 50)  # a float32 layout
    with pytest.raises(RuntimeError, match="x has 5 features, the weight takes 3 or 4"):
        op(torch.randn(1, 5).bfloat16(), pairs, None, 50)
    with pytest.raises(RuntimeError, match="the bias"):
        op(x.bfloat16(), pairs, torch.randn(50), 50)  # float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 8, 13, 64, 65, 130])
def test_a_residual_is_added_as_the_add_after_the_product_would(
    dtype: torch.dtype, tokens: int
) -> None:
    """``linear_panels`` with a residual, the add folded into the store, equals the
    product followed by ``residual + y`` to the bit (bfloat16 rounds the sum, then the
    add, as the two ops do); ``PackedLinear.plus`` takes it and falls back to the add
    without panels."""
    takes = BF16 if dtype == torch.bfloat16 else PANELS
    if not takes:
        return
    weight = _weight(100, 70, seed=tokens).to(dtype)  # 100 outputs: a panel ends mid-vector
    bias = torch.randn(100, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = torch.randn(tokens, 70, generator=torch.Generator().manual_seed(2)).to(dtype)
    residual = torch.randn(tokens, 100, generator=torch.Generator().manual_seed(3)).to(dtype)
    panels = to_panels(weight)
    op = torch.ops.tandem.linear_panels
    folded = op(x, panels, bias, 100, residual)
    assert folded.equal(residual + op(x, panels, bias, 100))
    packed = packing.PackedLinear(weight, bias, (100,), panels=panels)
    assert packed.plus(x, residual).equal(folded)
    plain = packing.PackedLinear(weight, bias, (100,))
    torch.testing.assert_close(plain.plus(x, residual), residual + F.linear(x, weight, bias))
    with pytest.raises(ValueError, match="single layer, not 2 stacked"):
        packing.PackedLinear(weight, bias, (50, 50), panels=panels).plus(x, residual)


def test_linear_panels_refuses_a_residual_it_cannot_add() -> None:
    if not PANELS:
        return
    panels = to_panels(_weight(50, 4, seed=2))
    op = torch.ops.tandem.linear_panels
    x = torch.randn(3, 4)
    for bad in (
        torch.randn(3, 49),
        torch.randn(2, 50),
        torch.randn(50, 3).t(),
        torch.randn(3, 50).double(),
    ):
        with pytest.raises(RuntimeError, match="the residual is a contiguous tensor"):
            op(x, panels, None, 50, bad)


def _packed(model: CausalLM) -> list[packing.PackedLinear]:
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    found = [attn.qkv, attn.o, mlp.gate_up, mlp.down]
    assert all(p is not None for p in found)
    # The head is packed with the projections, blocked: a oneDNN copy, or panels, or
    # neither where neither takes the dtype.
    assert model.head is not None
    assert all(p is not None and p.blocked for p in (*found, model.head))
    return [p for p in (*found, model.head) if p is not None]


@torch.no_grad()
def _logits_and_ops(model: CausalLM, n: int) -> tuple[torch.Tensor, set[str]]:
    ids = torch.randint(96, (n,), generator=torch.Generator().manual_seed(n))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        hidden = model(ids, torch.arange(n), DenseCausalAttention([n]))
        logits = model.compute_logits(hidden)
    return logits, {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_products_take_the_op_at_every_batch(dtype: torch.dtype) -> None:
    config = tiny_model_config(architectures=["LlamaForCausalLM"])
    model = load_model(None, config, dtype=dtype, device="cpu", load_format="dummy")
    model.pack(onednn=True, forward_threads=2)
    plain = CausalLM(model.config).to(dtype).eval()
    plain.load_state_dict(model.state_dict())
    model.use_fused_cpu_ops()
    plain.use_fused_cpu_ops()  # the same element-wise ops, unpacked products
    takes = BF16 if dtype == torch.bfloat16 else PANELS
    copies = packing.onednn_available(dtype)  # bfloat16 needs AVX-512 BW/VL/DQ or NE-CONVERT
    packed = _packed(model)
    assert all((p.panels is not None) == takes for p in packed)
    # The panels replace the oneDNN copy, and stand where oneDNN cannot take the dtype
    # (bfloat16 on AVX2).
    assert all((p.onednn is not None) == (copies and not takes) for p in packed)
    layers = len(model.model.layers)
    assert len(model.packed_weights()) == (4 * layers if copies or takes else 0)
    for n in (1, 2, 3, 9, 33):
        logits, ops = _logits_and_ops(model, n)
        want, _ = _logits_and_ops(plain, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(logits, want, rtol=tol, atol=tol)
        assert ("tandem::linear_panels" in ops) == takes


def test_a_tied_head_takes_panels_of_the_embedding() -> None:
    config = tiny_model_config(architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    model = load_model(None, config, dtype=torch.float32, device="cpu", load_format="dummy")
    model.pack(onednn=True, forward_threads=2)
    model.use_fused_cpu_ops()
    assert model.head is not None
    assert (model.head.panels is not None) == PANELS
    if PANELS:
        embedding = model.model.embed_tokens.weight
        assert model.head.panels.equal(to_panels(embedding))
        hidden = torch.randn(3, embedding.shape[1])
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, embedding))


def _wide_checkpoint(folder: Path) -> Path:
    """The default model's config at hidden 256 (the smallest with oneDNN copies);
    its weights come from ``load_format="dummy"``."""
    base = default_model_path()
    config = json.loads((base / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_hidden_layers=2)  # fmt: skip
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


PROMPTS = [[(7 * i + 3 * j) % 200 + 4 for j in range(5 + 9 * i)] for i in range(3)]


@torch.no_grad()
def _assert_equal_or_tied(model: CausalLM, got: list[list[int]], want: list[list[int]]) -> None:
    """``got`` equals ``want``, or each sequence that differs does so first at an honest
    tie: the two tokens' logits, from ``model`` over the prompt and the tokens before,
    within two units in bfloat16's last place. Two products that both sum exact
    products in float32 and round once (the op, and torch's own bfloat16 product on a CPU
    whose oneDNN cannot take it) still sum in different orders, and a sum that straddles
    a rounding point can turn a tied argmax."""
    prompts = [PROMPTS[0], *PROMPTS]  # the request alone, then the three together
    for prompt, ours, theirs in zip(prompts, got, want, strict=True):
        assert len(ours) == len(theirs)
        if ours == theirs:
            continue
        j = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        ids = torch.tensor(prompt + ours[:j])
        hidden = model(ids, torch.arange(len(ids)), DenseCausalAttention([len(ids)]))
        logits = model.compute_logits(hidden[-1:])[0].float()
        top = logits.max()
        margin = (top - logits[ours[j]]).item()
        assert margin <= 2 * 2**-7 * top.abs().item(), f"token {j}: {ours[j]} vs {theirs[j]}"


def _tokens(path: Path, overlap: bool, dtype: str) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path=str(path),
        load_format="dummy",
        dtype=dtype,
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        disable_overlap_schedule=not overlap,
    )
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (40, 12, 25)]
    try:
        # One request alone (one token a step), then three (three, then two, then one).
        alone = engine.generate(input_ids=PROMPTS[:1], sampling_params=params[:1])
        together = engine.generate(input_ids=PROMPTS, sampling_params=params)
        return [r["output_ids"] for r in alone + together], engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_engine_tokens_with_the_op_equal_tokens_without(
    overlap: bool, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    takes = BF16 if dtype == "bfloat16" else PANELS
    path = _wide_checkpoint(tmp_path / "wide")
    with_op, engine = _tokens(path, overlap, dtype)
    model = engine.scheduler.runner.model
    assert all((p.panels is not None) == takes for p in _packed(model))
    # The forward runs on the engine's worker thread, out of the profiler's sight: the
    # engine's own packed product, called here, shows that it takes the op.
    down = _packed(model)[3]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        down(torch.randn(1, down.weight.shape[1], dtype=down.weight.dtype))
    ops = {event.key for event in prof.key_averages()}
    assert ("tandem::linear_panels" in ops) == takes
    trace = engine.scheduler.runner.decode_trace
    assert trace is not None
    assert trace.replays > 0
    monkeypatch.setattr(packing, "panels_available", lambda *_: False)
    without, reference = _tokens(path, overlap, dtype)
    reference_model = reference.scheduler.runner.model
    assert all(p.panels is None for p in _packed(reference_model))
    if dtype == "float32" or packing.onednn_available(torch.bfloat16):
        assert with_op == without  # the same arithmetic: oneDNN's pairs, in pair order
    else:
        _assert_equal_or_tied(reference_model, with_op, without)
    assert [len(ids) for ids in with_op] == [40, 40, 12, 25]
