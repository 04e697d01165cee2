"""tandem's product by quantized weights (``torch.ops.tandem.linear_quant``, built from
``kernels/cpu_quant.cpp`` on CPUs with AVX2 and FMA or AVX-512) against dequantize-then-
multiply: for both kinds of code, every GGUF type it takes (their blocks decoded by
``quant_rows``, checked against the ``gguf`` library's dequantization), at row counts
below, at and above its tiles and its work items' 64 rows, output sizes that end mid-panel or
mid-vector, one to three blocks and one block a row, on one thread and on two; the
code layout's repacking; the inputs it refuses; and the AVX2 build on an AVX-512
machine, in a child process.

Tolerance, per output, every type alike: within 1e-5 of ``|x| @ |w|.T + |bias| +
|residual|`` (float32 rounding of a few hundred terms, with margin), the sums' order
aside. The int8 dot products round x per block to two 8-bit parts (an error of at most
``max|x| / 32,512`` per input, twice the rounding's), or with ``parts=1`` to one, as
llama.cpp does (``max|x| / 254``), and that error times ``|w|`` is added to the bound:
the product is the weight's with x as rounded, offsets included (they multiply the
rounded x's sums). The dot products are AVX512-VNNI's, or AVX2's on CPUs without it:
the same sums, exactly, in integers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models.quant_panels import PANEL_COLUMNS, QuantPanels, to_quant_panels
from tandem.scheduler.models.quant_rows import KERNEL_TYPES, RowQuant, decode_gguf, quantize_int8
from tandem.scheduler.models.quantized import quant_kernel
from tandem.scheduler.models.tiny import cache_root

CAPABILITY = torch.backends.cpu.get_cpu_capability()
QUANT = CAPABILITY in ("AVX2", "AVX512")
RELATIVE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")


def _rows(kind: str, rows: int, cols: int, block: int, seed: int, half: bool = False) -> RowQuant:
    """Random codes with float32 scales (and offsets), or with ``half`` values exact in
    float16, which the panels then hold in it."""
    gen = torch.Generator().manual_seed(seed)
    groups = (rows, cols // block)

    def values(t: torch.Tensor) -> torch.Tensor:
        return t.half().float() if half else t

    scales = values(torch.rand(groups, generator=gen) * 0.02)
    if kind == "u4":
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
        offsets = values((torch.rand(groups, generator=gen) - 0.5) * 0.1)
        return RowQuant(codes, scales, offsets, block, "u4-test")
    codes = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return RowQuant(codes, scales, None, block, "i8-test")


def _check(
    panels: QuantPanels,
    weight: RowQuant,
    tokens: int,
    *,
    bias: bool = False,
    residual: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """The op's output against the float64 product of ``weight``, within the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = weight.shape
    dense = weight.dequantize().double()
    x = torch.randn(tokens, cols, generator=gen)
    b = torch.randn(rows, generator=gen) if bias else None
    r = torch.randn(tokens, rows, generator=gen) if residual else None
    got = panels(x, b, r)
    want = x.double() @ dense.T
    scale = RELATIVE * (x.double().abs() @ dense.abs().T)
    if b is not None:
        want, scale = want + b.double(), scale + RELATIVE * b.double().abs()
    if r is not None:
        want, scale = want + r.double(), scale + RELATIVE * r.double().abs()
    if tokens:
        # x's rounding: half a unit of 1 / 127 of the block's largest |x|, or of 1 / 256
        # of that with two parts (twice that here: a rest of exactly half is clamped).
        unit = 254 if panels.parts == 1 else 127 * 256
        step = x.view(tokens, -1, weight.block).abs().amax(dim=2, keepdim=True) / unit
        rounding = step.expand(-1, -1, weight.block).reshape(tokens, cols).double()
        scale = scale + rounding @ dense.abs().T
    assert got.shape == (tokens, rows)
    assert got.dtype == torch.float32
    excess = (got.double() - want).abs() - scale - 1e-12
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3e}"
    return got


def test_the_op_exists_exactly_on_avx2_and_up() -> None:
    assert quant_kernel() == QUANT


@pytest.mark.parametrize("kind", ["u4", "i8"])
def test_the_panels_give_back_every_row(kind: str) -> None:
    weight = _rows(kind, 100, 64, 32, seed=4)
    panels = to_quant_panels(weight)
    assert panels.codes.shape == (3, 64 // (8 if kind == "u4" else 4), 4 * PANEL_COLUMNS)
    assert torch.equal(panels.dequantize(), weight.dequantize())
    ids = torch.tensor([[99, 0], [47, 48]])
    assert torch.equal(panels.rows(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("kind", ["u4", "i8"])
def test_panels_hold_each_columns_codes_for_four_inputs_side_by_side(kind: str) -> None:
    weight = _rows(kind, 50, 64, 32, seed=1)
    panels = to_quant_panels(weight)
    per_row = 8 if kind == "u4" else 4
    assert panels.codes.shape == (2, 64 // per_row, 4 * PANEL_COLUMNS)
    assert panels.codes.is_contiguous()
    assert panels.scales.shape == (2, 2, PANEL_COLUMNS)
    for col in (0, 17, 47, 48, 49):
        p, c = divmod(col, PANEL_COLUMNS)
        quads = panels.codes[p, :, 4 * c : 4 * c + 4]  # [in / per_row, 4]
        if kind == "u4":  # inputs 8j..8j+3 in the low nibbles, 8j+4..8j+7 the high
            codes = torch.cat((quads & 15, quads >> 4), dim=1).flatten()
        else:  # inputs 4j..4j+3, each plus 128
            codes = (quads.to(torch.int16) - 128).flatten().to(torch.int8)
        assert torch.equal(codes, weight.codes[col])
        assert torch.equal(panels.scales[p, :, c], weight.scales[col])
    padding = panels.codes[1, :, 4 * 2 :]  # the columns past the 50th: code 0
    assert bool((padding == (0 if kind == "u4" else 128)).all())
    assert not panels.scales[1, :, 2:].any()


@pytest.mark.parametrize("kind", ["u4", "i8"])
def test_scales_exact_in_float16_are_held_in_it(kind: str) -> None:
    exact = to_quant_panels(_rows(kind, 100, 64, 32, seed=3, half=True))
    assert exact.scales.dtype == torch.float16
    assert exact.offsets is None or exact.offsets.dtype == torch.float16
    # A Q4_1 block of 32 then takes 16 bytes of codes and 2 + 2 of scale and offset.
    per_block = (16 + 2 + 2) if kind == "u4" else (32 + 2)
    assert exact.nbytes == 3 * PANEL_COLUMNS * (64 // 32) * per_block
    assert torch.equal(exact.dequantize(), _rows(kind, 100, 64, 32, seed=3, half=True).dequantize())
    assert to_quant_panels(_rows(kind, 100, 64, 32, seed=3)).scales.dtype == torch.float32
    if kind == "u4":  # float16 only where the offsets are exact in it too
        weight = _rows(kind, 100, 64, 32, seed=3, half=True)
        inexact = RowQuant(weight.codes, weight.scales, weight.offsets + 1e-6, 32, "u4-test")
        panels = to_quant_panels(inexact)
        assert panels.scales.dtype == panels.offsets.dtype == torch.float32


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 65, 130])
@pytest.mark.parametrize(
    ("kind", "rows", "cols", "block"),
    [
        ("u4", 200, 96, 32),  # three blocks, a panel ending mid-vector
        ("u4", 49, 32, 32),  # one block, one column past a panel
        ("u4", 48, 16, 8),  # the smallest blocks of 4-bit codes
        ("i8", 100, 64, 32),
        ("i8", 47, 48, 16),  # Q6_K's blocks of 16
        ("i8", 1, 160, 160),  # one block a row, one output
        ("i8", 96, 40, 8),
    ],
)
def test_the_product_equals_dequantize_then_multiply(
    tokens: int, kind: str, rows: int, cols: int, block: int, half: bool
) -> None:
    if not QUANT:
        return  # test_the_op_exists_exactly_on_avx2_and_up checks it is absent
    weight = _rows(kind, rows, cols, block, seed=rows + cols, half=half)
    panels = to_quant_panels(weight)
    assert panels.scales.dtype == (torch.float16 if half else torch.float32)
    _check(panels, weight, tokens, seed=tokens)


@pytest.mark.parametrize("tokens", [1, 4, 5, 9, 70])
@pytest.mark.parametrize("kind", ["u4", "i8"])
def test_x_in_one_8_bit_part_as_llama_cpp_rounds_it(tokens: int, kind: str) -> None:
    if not QUANT:
        return
    weight = _rows(kind, 100, 96, 32, seed=tokens)
    panels = to_quant_panels(weight, parts=1)
    _check(panels, weight, tokens, bias=True, seed=tokens)
    x = torch.randn(tokens, 96)
    assert not torch.equal(panels(x), to_quant_panels(weight)(x))


def test_int8_of_a_long_row_keeps_its_block_sums_in_32_bits() -> None:
    """A row that 32 does not divide is quantized in blocks of at most 512: the whole
    row's 1,000 codes of 127 times x's joined parts (127 x 256 each) overflowed the
    block's 32-bit sum, and the product came out negative."""
    if not QUANT:
        return
    form = quantize_int8(torch.full((3, 1000), 0.5))
    assert form.block == 500
    got = to_quant_panels(form)(torch.ones(2, 1000))
    assert torch.allclose(got, torch.full((2, 3), 500.0), rtol=1e-5)


def _rounded(x: torch.Tensor, block: int, parts: int) -> torch.Tensor:
    """x as the int8 path rounds it, block by block, in the kernel's float32 steps: the
    scale ``max|x| / 127``, the whole units to nearest (ties to even), with two parts the
    rest in 256ths of a unit (clamped to 127), then ``scale * (whole + rest / 256)``."""
    blocks = x.view(x.shape[0], -1, block)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    units = blocks * inverse
    whole = torch.round(units)
    rest = torch.round((units - whole) * 256).clamp(-127, 127)
    rest = rest if parts == 2 else torch.zeros_like(whole)
    return (scale.double() * (whole.double() + rest.double() / 256)).view_as(x)


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("kind", ["u4", "i8"])
@pytest.mark.parametrize("tokens", [1, 4, 9, 20])
def test_the_product_is_the_weights_times_x_as_rounded(parts: int, kind: str, tokens: int) -> None:
    """Offsets too multiply x as rounded, not x itself: the rounding errors then meet
    the weights, of either sign, rather than the codes' steps above the offset, all of
    one sign, which add them up (the perplexity with one part: docs/benchmarks.md)."""
    if not QUANT:
        return
    weight = _rows(kind, 130, 96, 32, seed=tokens + parts)
    panels = to_quant_panels(weight, parts=parts)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens)) + 0.5
    rounded = _rounded(x, 32, parts)
    dense = weight.dequantize().double()
    want = rounded @ dense.T
    bound = RELATIVE * (rounded.abs() @ dense.abs().T) + 1e-12
    assert ((panels(x).double() - want).abs() <= bound).all()


@pytest.mark.parametrize("tokens", [1, 3, 8, 70])
def test_bias_and_residual_are_added_to_the_finished_product(tokens: int) -> None:
    if not QUANT:
        return
    for kind in ("u4", "i8"):
        weight = _rows(kind, 130, 64, 32, seed=5)
        _check(to_quant_panels(weight), weight, tokens, bias=True, residual=True)


@pytest.mark.parametrize("tokens", [1, 5, 9, 200])
def test_one_thread_and_two_give_the_same_bits(tokens: int) -> None:
    if not QUANT:
        return
    weight = to_quant_panels(_rows("u4", 300, 128, 32, seed=2))
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight(x)
        torch.set_num_threads(2)
        two = weight(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one work item's, whatever the split


def _gguf_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks: random bytes with each block's f16 scales set small."""
    block, size = GGML_QUANT_SIZES[qtype]
    scale_at = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in scale_at[qtype.name]:
        scale = rng.uniform(0.001, 0.02, (rows, cols // block, 1)).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
@pytest.mark.parametrize("tokens", [1, 4, 9, 40])
def test_every_gguf_type_multiplies_as_the_librarys_dequantization(qtype: str, tokens: int) -> None:
    if not QUANT:
        return
    kind = GGMLQuantizationType[qtype]
    rows, cols = 97, 512  # two K-quant super-blocks, a panel ending mid-vector
    raw = _gguf_blocks(kind, rows, cols, seed=tokens)
    reference = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols))
    weight = decode_gguf(raw, kind, rows, cols, "blk.0.test.weight")
    panels = to_quant_panels(weight)
    assert panels.qtype == qtype
    assert torch.equal(panels.dequantize(), reference)
    _check(panels, weight, tokens, bias=True, seed=tokens)


def _refused(match: str, *args: object) -> None:
    with pytest.raises(RuntimeError, match=match):
        torch.ops.tandem.linear_quant(*args)


def test_bad_operands_are_refused_naming_the_problem() -> None:
    if not QUANT:
        return
    u4 = to_quant_panels(_rows("u4", 60, 64, 32, seed=0))
    i8 = to_quant_panels(_rows("i8", 60, 64, 32, seed=0))
    x = torch.randn(3, 64)
    op = (u4.codes, u4.scales, u4.offsets, 32)
    _refused("float32 x", x.double(), *op, None, 60)
    _refused("whole blocks of 32", torch.randn(3, 48), *op, None, 60)
    _refused("codes must be a contiguous", x, u4.codes[:, :1], u4.scales, u4.offsets, 32, None, 60)
    _refused("output features", x, *op, None, 97)
    _refused("scales must be", x, u4.codes, u4.scales[:, :1], u4.offsets, 32, None, 60)
    _refused("scales must be", x, u4.codes, u4.scales.double(), u4.offsets, 32, None, 60)
    _refused("typed as the scales", x, u4.codes, u4.scales, u4.offsets.half(), 32, None, 60)
    # 4-bit codes are the ones with offsets: swapped, their layout does not fit.
    _refused("codes", x, u4.codes, u4.scales, None, 32, None, 60)
    _refused("codes", x, i8.codes, i8.scales, i8.scales, 32, None, 60)
    _refused("codes are uint8", x, u4.codes.float(), u4.scales, u4.offsets, 32, None, 60)
    _refused("bias", x, *op, torch.randn(59), 60)
    _refused("residual", x, *op, None, 60, torch.randn(3, 59))


AVX2_CHILD = """
import torch
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models.tiny import cache_root
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
assert cpu_build.load_cpu_kernels(cache_root() / "kernels")
assert cpu_build.panel_halves()  # the AVX2 build
import test_cpu_quant as t
for tokens in (0, 1, 2, 3, 5, 9, 65):
    for kind, rows, cols, block in (("u4", 200, 96, 32), ("i8", 47, 48, 16), ("i8", 1, 40, 8)):
        for half in (False, True):
            weight = t._rows(kind, rows, cols, block, seed=tokens, half=half)
            t._check(t.to_quant_panels(weight), weight, tokens, bias=True, residual=True)
print("ok")
"""


def test_the_avx2_build_on_an_avx512_machine() -> None:
    if CAPABILITY != "AVX512":
        return  # an AVX2 machine runs every test above on its own build
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", AVX2_CHILD],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
