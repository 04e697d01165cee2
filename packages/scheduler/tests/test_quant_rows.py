"""The common row form of quantized weights (``quant_rows``): every kernel type decodes from
GGUF bytes to codes, scales and offsets whose ``dequantize`` matches gguf-py's own
dequantization exactly; bad layouts are refused with the tensor's name; tandem's int8
quantization stays within half a step; and slicing and stacking rows keep the weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tandem.scheduler.models.quant_rows import (
    KERNEL_TYPES,
    RowQuant,
    decode_gguf,
    quantize_int8,
)

Q = GGMLQuantizationType

# Byte offset and value range of each fp16 field of a block (the rest is random bytes).
_FP16_FIELDS: dict[GGMLQuantizationType, list[tuple[int, float, float]]] = {
    Q.Q8_0: [(0, -0.05, 0.05)],
    Q.Q4_0: [(0, -0.05, 0.05)],
    Q.Q4_1: [(0, -0.05, 0.05), (2, -0.05, 0.05)],
    Q.Q4_K: [(0, 0.0, 0.05), (2, 0.0, 0.05)],
    Q.Q6_K: [(208, -0.05, 0.05)],
}
# (kind, group size, smallest code, largest code) of each type's row form.
_FORM: dict[GGMLQuantizationType, tuple[str, int, int, int]] = {
    Q.Q8_0: ("i8", 32, -128, 127),
    Q.Q4_0: ("u4", 32, 0, 15),
    Q.Q4_1: ("u4", 32, 0, 15),
    Q.Q4_K: ("u4", 32, 0, 15),
    Q.Q6_K: ("i8", 16, -32, 31),
}
_SHAPES = [(rows, blocks) for rows in (1, 3, 50) for blocks in (1, 2, 3)]


def _random_raw(
    qtype: GGMLQuantizationType, rows: int, blocks: int, seed: int, wide: bool
) -> np.ndarray:
    """Random blocks [rows, row_bytes]; fp16 fields are uniform in their range, or with
    ``wide`` any finite fp16 (zeros, subnormals and 65504 included)."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    n = rows * blocks
    raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for at, low, high in _FP16_FIELDS[qtype]:
        if wide:
            bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # inf / NaN -> a subnormal
            values = bits.view("<f2")
        else:
            values = rng.uniform(low, high, size=n).astype("<f2")
        raw[:, at : at + 2] = values.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, blocks * type_size)


def _assert_same_as_gguf(form: RowQuant, raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    ours = form.dequantize().numpy()
    ref = dequantize(raw, qtype)
    assert ref.dtype == np.float32
    assert ours.shape == ref.shape
    if qtype == Q.Q4_0:
        # d*q + (-8d) is exactly gguf's d*(q-8), but a zero comes out +0 where gguf has -0.
        assert np.array_equal(ours, ref)
    else:
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_kernel_types_are_the_decoded_ones() -> None:
    assert {t.name for t in _FORM} == KERNEL_TYPES


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize(("rows", "blocks"), _SHAPES)
@pytest.mark.parametrize("qtype", list(_FORM), ids=lambda t: t.name)
def test_decode_matches_gguf_dequantize(
    qtype: GGMLQuantizationType, rows: int, blocks: int, wide: bool
) -> None:
    raw = _random_raw(qtype, rows, blocks, seed=rows * 10 + blocks, wide=wide)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    cols = blocks * block_size
    form = decode_gguf(raw, qtype, rows, cols, "blk.0.ffn_up.weight")

    kind, group, low, high = _FORM[qtype]
    assert (form.kind, form.block, form.qtype, form.shape) == (
        kind,
        group,
        qtype.name,
        (rows, cols),
    )
    assert form.codes.dtype == (torch.uint8 if kind == "u4" else torch.int8)
    assert form.scales.dtype == torch.float32
    assert form.scales.shape == (rows, cols // group)
    if kind == "u4":
        assert form.offsets is not None
        assert form.offsets.dtype == torch.float32
        assert form.offsets.shape == form.scales.shape
        assert form.offsets.is_contiguous()
    else:
        assert form.offsets is None
    assert form.codes.is_contiguous()
    assert form.scales.is_contiguous()
    assert low <= int(form.codes.min())
    assert int(form.codes.max()) <= high
    _assert_same_as_gguf(form, raw, qtype)


def test_codes_follow_the_documented_layout() -> None:
    """Hand-built blocks: Q4_0 nibbles (low nibbles first) and Q8_0's int8 bytes."""
    low = np.arange(16, dtype=np.uint8)
    block = np.concatenate([np.array([1.0], "<f2").view(np.uint8), low | ((15 - low) << 4)])
    form = decode_gguf(block, Q.Q4_0, 1, 32, "w")
    assert form.codes[0].tolist() == list(range(16)) + list(range(15, -1, -1))
    assert form.scales.tolist() == [[1.0]]
    assert form.offsets is not None
    assert form.offsets.tolist() == [[-8.0]]

    q8 = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([0.5], "<f2").view(np.uint8), q8.view(np.uint8)])
    form = decode_gguf(block, Q.Q8_0, 1, 32, "w")
    assert form.codes[0].tolist() == q8.tolist()
    assert form.dequantize()[0].tolist() == (q8 * 0.5).tolist()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_round_trip_through_gguf_quantize(qtype: GGMLQuantizationType) -> None:
    """gguf-py quantizes these three; K-quants it only dequantizes."""
    weight = np.random.default_rng(7).normal(0.0, 0.02, size=(24, 96)).astype(np.float32)
    weight[3] = 0.0
    raw = quantize(weight, qtype)
    form = decode_gguf(raw, qtype, 24, 96, "w")
    _assert_same_as_gguf(form, raw, qtype)

    blocks = weight.reshape(24, 3, 32)
    if qtype == Q.Q8_0:
        step = np.abs(blocks).max(axis=-1) / 127
    elif qtype == Q.Q4_0:
        step = np.abs(blocks).max(axis=-1) / 8
    else:
        step = (blocks.max(axis=-1) - blocks.min(axis=-1)) / 15
    error = np.abs(form.dequantize().numpy().reshape(24, 3, 32) - blocks).max(axis=-1)
    assert np.all(error <= step * 1.001 + 1e-7)


def test_wrong_byte_count_is_refused_with_the_name() -> None:
    raw = _random_raw(Q.Q4_K, 2, 1, seed=0, wide=False).reshape(-1)
    with pytest.raises(ValueError, match=r"tensor blk\.3\.attn_q\.weight: .*bytes"):
        decode_gguf(raw[:-1], Q.Q4_K, 2, 256, "blk.3.attn_q.weight")
    with pytest.raises(ValueError, match=r"tensor blk\.3\.attn_q\.weight"):
        decode_gguf(raw, Q.Q4_K, 3, 256, "blk.3.attn_q.weight")
    with pytest.raises(ValueError, match=r"tensor blk\.3\.attn_q\.weight"):
        decode_gguf(np.concatenate([raw, raw[:1]]), Q.Q4_K, 2, 256, "blk.3.attn_q.weight")


def test_columns_not_whole_blocks_are_refused_with_the_name() -> None:
    raw = np.zeros(34, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"tensor output\.weight: .*Q8_0 blocks of 32"):
        decode_gguf(raw, Q.Q8_0, 1, 33, "output.weight")
    with pytest.raises(ValueError, match=r"tensor output\.weight"):
        decode_gguf(np.zeros(144, dtype=np.uint8), Q.Q4_K, 1, 128, "output.weight")


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q2_K, Q.F16], ids=lambda t: t.name)
def test_unsupported_type_is_refused(qtype: GGMLQuantizationType) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros(type_size, dtype=np.uint8)
    with pytest.raises(ValueError, match=rf"tensor token_embd\.weight: type {qtype.name}\b"):
        decode_gguf(raw, qtype, 1, block_size, "token_embd.weight")


def test_quantize_int8_is_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 72, generator=gen) * torch.rand(40, 1, generator=gen)
    weight[5] = 0.0
    weight[9, 17] = 1e4  # one outlier dominates its row's scale
    form = quantize_int8(weight, "attn_q")

    assert (form.kind, form.block, form.qtype, form.shape) == ("i8", 72, "attn_q", (40, 72))
    assert form.offsets is None
    assert form.scales.shape == (40, 1)
    assert form.scales.dtype == torch.float32
    assert int(form.codes.min()) >= -127
    assert int(form.codes.max()) <= 127
    error = (form.dequantize() - weight).abs()
    assert bool((error <= form.scales / 2 * (1 + 1e-5) + 1e-12).all())
    assert bool((form.dequantize()[5] == 0).all())
    nonzero = [r for r in range(40) if r != 5]
    assert form.codes[nonzero].abs().amax(dim=1).eq(127).all()


@pytest.mark.parametrize(
    ("cols", "block"), [(64, 32), (72, 72), (1000, 500), (1536, 32), (2052, 228), (1030, 1030)]
)
def test_quantize_int8_splits_a_row_the_default_does_not_divide(cols: int, block: int) -> None:
    """The longest block of at most 512 inputs, a multiple of 4, that divides the row
    (the kernel's 32-bit block sums); the whole row where none does."""
    form = quantize_int8(torch.randn(2, cols, generator=torch.Generator().manual_seed(cols)))
    assert form.block == block
    assert form.scales.shape == (2, cols // block)


def test_quantize_int8_chunks_and_dtypes_agree() -> None:
    weight = torch.randn(33, 40, generator=torch.Generator().manual_seed(4))
    whole = quantize_int8(weight)
    chunked = quantize_int8(weight, chunk_values=100)  # two rows at a time, then one
    assert torch.equal(whole.codes, chunked.codes)
    assert torch.equal(whole.scales, chunked.scales)
    half = quantize_int8(weight.to(torch.bfloat16))
    assert torch.equal(
        half.dequantize(), quantize_int8(weight.to(torch.bfloat16).float()).dequantize()
    )


def test_quantize_int8_refuses_bad_weights() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        quantize_int8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(4))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_rows_slice_and_cat_keep_the_weight(qtype: GGMLQuantizationType) -> None:
    form = decode_gguf(_random_raw(qtype, 50, 2, seed=11, wide=False), qtype, 50, 512, "w")
    full = form.dequantize()
    parts = [form.rows_slice(0, 7), form.rows_slice(7, 7), form.rows_slice(7, 50)]
    assert [p.shape for p in parts] == [(7, 512), (0, 512), (43, 512)]
    assert torch.equal(parts[2].dequantize(), full[7:50])
    stacked = RowQuant.cat(parts)
    assert stacked.qtype == qtype.name
    assert stacked.block == form.block
    assert torch.equal(stacked.codes, form.codes)
    assert torch.equal(stacked.scales, form.scales)
    assert torch.equal(stacked.dequantize(), full)
    with pytest.raises(ValueError, match="outside"):
        form.rows_slice(10, 51)
    with pytest.raises(ValueError, match="outside"):
        form.rows_slice(5, 4)


def test_cat_mixes_types_of_one_form_only() -> None:
    q41 = decode_gguf(_random_raw(Q.Q4_1, 3, 8, seed=1, wide=False), Q.Q4_1, 3, 256, "a")
    q4k = decode_gguf(_random_raw(Q.Q4_K, 2, 1, seed=2, wide=False), Q.Q4_K, 2, 256, "b")
    mixed = RowQuant.cat([q41, q4k, q41])
    assert mixed.qtype == "Q4_1+Q4_K"
    assert mixed.shape == (8, 256)
    assert torch.equal(
        mixed.dequantize(), torch.cat([q41.dequantize(), q4k.dequantize(), q41.dequantize()])
    )

    q8 = decode_gguf(_random_raw(Q.Q8_0, 2, 8, seed=3, wide=False), Q.Q8_0, 2, 256, "c")
    q6k = decode_gguf(_random_raw(Q.Q6_K, 2, 1, seed=4, wide=False), Q.Q6_K, 2, 256, "d")
    narrow = decode_gguf(_random_raw(Q.Q4_1, 2, 4, seed=5, wide=False), Q.Q4_1, 2, 128, "e")
    for bad in ([q41, q8], [q8, q6k], [q41, narrow], []):
        with pytest.raises(ValueError, match=r"stack|at least one"):
            RowQuant.cat(bad)


def test_row_form_checks_its_parts() -> None:
    codes = torch.zeros(2, 64, dtype=torch.uint8)
    scales = torch.ones(2, 2)
    with pytest.raises(ValueError, match="offsets"):
        RowQuant(codes, scales, None, 32, "Q4_1")
    with pytest.raises(ValueError, match="no offsets"):
        RowQuant(codes.to(torch.int8), scales, scales, 32, "Q8_0")
    with pytest.raises(ValueError, match="scales"):
        RowQuant(codes.to(torch.int8), torch.ones(2, 3), None, 32, "Q8_0")
    with pytest.raises(ValueError, match="blocks of 48"):
        RowQuant(codes.to(torch.int8), scales, None, 48, "Q8_0")
