"""Quantized weights in one common row form, for CPU kernels that multiply by them directly.

Every supported GGUF block type (and tandem's own weight-only int8) is decoded once, at load,
into ``RowQuant``: small integer codes per weight plus a float32 scale (and, for 4-bit codes,
an offset) per block of inputs of each row. The kernels then need to know two layouts, not
one per GGUF type, and ``dequantize`` reproduces ``gguf.quants.dequantize`` value for value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KERNEL_TYPES: frozenset[str] = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"})

# quantize_int8 converts at most this many weights to float32 at a time (16 MB).
CHUNK_VALUES = 1 << 22


@dataclass(frozen=True, eq=False)
class RowQuant:
    """A [rows, cols] weight as small integer codes and, per block of ``block`` inputs of
    each row, a float32 scale and (for the 4-bit kind) an offset:
    w[r, c] = scales[r, c // block] * codes[r, c] (+ offsets[r, c // block])."""

    codes: torch.Tensor  # [rows, cols]: uint8 in 0..15 (kind "u4") or int8 (kind "i8")
    scales: torch.Tensor  # [rows, cols // block] float32
    offsets: torch.Tensor | None  # [rows, cols // block] float32 for "u4"; None for "i8"
    block: int
    qtype: str  # the source type's name: "Q4_1", "Q6_K", "int8", ...

    def __post_init__(self) -> None:
        if self.codes.dim() != 2 or self.codes.dtype not in (torch.uint8, torch.int8):
            raise ValueError(
                f"{self.qtype}: codes must be a 2-D uint8 or int8 tensor, got "
                f"{self.codes.dtype} {tuple(self.codes.shape)}"
            )
        rows, cols = self.codes.shape
        if self.block <= 0 or cols % self.block:
            raise ValueError(
                f"{self.qtype}: {cols} columns do not split into blocks of {self.block}"
            )
        groups = (rows, cols // self.block)
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != groups:
            raise ValueError(
                f"{self.qtype}: scales must be float32 {groups}, got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.kind == "i8":
            if self.offsets is not None:
                raise ValueError(f"{self.qtype}: int8 codes take no offsets")
        elif self.offsets is None or (
            self.offsets.dtype != torch.float32 or tuple(self.offsets.shape) != groups
        ):
            raise ValueError(f"{self.qtype}: 4-bit codes need float32 offsets of shape {groups}")

    @property
    def kind(self) -> str:
        """``"u4"`` for uint8 codes in 0..15, ``"i8"`` for int8 codes."""
        return "u4" if self.codes.dtype == torch.uint8 else "i8"

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the weight."""
        rows, cols = self.codes.shape
        return rows, cols

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [rows, cols]: scale * code, plus the offset for "u4"."""
        rows, cols = self.shape
        groups = cols // self.block
        values = self.codes.to(torch.float32).reshape(rows, groups, self.block)
        values = values * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            values = values + self.offsets.unsqueeze(-1)
        return values.reshape(rows, cols)

    def rows_slice(self, start: int, stop: int) -> RowQuant:
        """Rows ``start:stop`` (views sharing this weight's storage)."""
        rows = self.shape[0]
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"{self.qtype}: rows {start}:{stop} are outside 0:{rows}")
        offsets = None if self.offsets is None else self.offsets[start:stop]
        return RowQuant(
            self.codes[start:stop], self.scales[start:stop], offsets, self.block, self.qtype
        )

    @classmethod
    def cat(cls, parts: Sequence[RowQuant]) -> RowQuant:
        """The rows of ``parts`` stacked in order (e.g. fused q/k/v). They must share kind,
        block and column count; mixed source types give a qtype like ``"Q4_1+Q4_K"``."""
        if not parts:
            raise ValueError("cat needs at least one part")
        first = parts[0]
        for part in parts[1:]:
            if (part.kind, part.block, part.shape[1]) != (first.kind, first.block, first.shape[1]):
                raise ValueError(
                    f"cannot stack {part.qtype} ({part.kind}, block {part.block}, "
                    f"{part.shape[1]} cols) under {first.qtype} ({first.kind}, block "
                    f"{first.block}, {first.shape[1]} cols)"
                )
        offsets = None
        if first.offsets is not None:
            offsets = torch.cat([p.offsets for p in parts if p.offsets is not None])
        qtype = "+".join(dict.fromkeys(p.qtype for p in parts))
        return cls(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            offsets,
            first.block,
            qtype,
        )


# One decoder per GGUF type: blocks [n, type_size] uint8 -> (codes [n, block_size],
# scales [n, groups] float32, offsets [n, groups] float32 or None, group size).
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian fp16 field at byte ``at`` of each block, as float32 [n, 1]."""
    field = np.ascontiguousarray(blocks[:, at : at + 2])
    return field.view("<f2").astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [n, k] -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _decode_q8_0(blocks: np.ndarray) -> _Decoded:
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    return codes, _fp16(blocks, 0), None, 32


def _decode_q4_0(blocks: np.ndarray) -> _Decoded:
    d = _fp16(blocks, 0)
    # d * code - 8 * d equals gguf's d * (code - 8) exactly: both products are exact.
    return _nibbles(blocks[:, 2:]), d, np.float32(-8) * d, 32


def _decode_q4_1(blocks: np.ndarray) -> _Decoded:
    return _nibbles(blocks[:, 4:]), _fp16(blocks, 0), _fp16(blocks, 2), 32


def _decode_q4_k(blocks: np.ndarray) -> _Decoded:
    n = blocks.shape[0]
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    # 12 bytes hold eight 6-bit scales and eight 6-bit mins. Bytes 0-3 / 4-7 carry the low
    # 6 bits of scales / mins 0-3 and, in their top 2 bits, the high bits of scales / mins
    # 4-7, whose low 4 bits are the low / high nibbles of bytes 8-11.
    packed = blocks[:, 4:16]
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    # 128 bytes in four runs of 32: sub-block 2i is run i's low nibbles, 2i+1 its high ones.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    scales = d * sc.astype(np.float32)
    offsets = -(dmin * mins.astype(np.float32))
    return codes, scales, offsets, 32


def _decode_q6_k(blocks: np.ndarray) -> _Decoded:
    n = blocks.shape[0]
    # Each 128-weight half takes 64 bytes of ql (low nibbles for weights 0-63, high nibbles
    # for 64-127) and 32 bytes of qh (2-bit pairs at shifts 0, 2, 4, 6 for weights 0-31, ...).
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 256)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 0x03).reshape(n, 256)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    scales = _fp16(blocks, 208) * sc.astype(np.float32)
    return codes, scales, None, 16


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], _Decoded]] = {
    GGMLQuantizationType.Q8_0: _decode_q8_0,
    GGMLQuantizationType.Q4_0: _decode_q4_0,
    GGMLQuantizationType.Q4_1: _decode_q4_1,
    GGMLQuantizationType.Q4_K: _decode_q4_k,
    GGMLQuantizationType.Q6_K: _decode_q6_k,
}


def _tensor(array: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array.reshape(shape)))


def decode_gguf(
    raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int, name: str
) -> RowQuant:
    """Decode a GGUF tensor's bytes (row-major, as stored) into row form.

    Raises ``ValueError`` naming the tensor for a type without a kernel, a column count
    that is not whole blocks, or a byte count other than rows * row_bytes.
    """
    qtype = GGMLQuantizationType(qtype)
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        raise ValueError(
            f"tensor {name}: type {qtype.name} has no quantized kernel "
            f"(supported: {', '.join(sorted(KERNEL_TYPES))})"
        )
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if rows < 0 or cols <= 0 or cols % block_size:
        raise ValueError(
            f"tensor {name}: shape ({rows}, {cols}) is not whole {qtype.name} blocks "
            f"of {block_size} per row"
        )
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    per_row = cols // block_size
    expected = rows * per_row * type_size
    if data.size != expected:
        raise ValueError(
            f"tensor {name}: {data.size} bytes, but {qtype.name} ({rows}, {cols}) takes {expected}"
        )
    codes, scales, offsets, block = decoder(data.reshape(rows * per_row, type_size))
    groups = (rows, cols // block)
    return RowQuant(
        codes=_tensor(codes, (rows, cols)),
        scales=_tensor(scales, groups),
        offsets=None if offsets is None else _tensor(offsets, groups),
        block=block,
        qtype=qtype.name,
    )


INT8_BLOCK = 32
"""Inputs per scale of ``quantize_int8``: Q8_0's blocks, which the CPU kernel's int8 dot
products read as they read that type's."""

INT8_LONGEST_BLOCK = 512
"""The longest block ``quantize_int8`` makes of a row that ``INT8_BLOCK`` does not
divide: the kernel sums a block's codes (up to 128) times x's two 8-bit parts joined
(up to 32,639) in 32 bits, which holds up to 514 inputs."""


def _row_block(cols: int) -> int:
    """The longest block of ``cols`` inputs the kernel takes: a multiple of 4 dividing
    the row, at most ``INT8_LONGEST_BLOCK``; the whole row where none does."""
    for block in range(min(cols, INT8_LONGEST_BLOCK) // 4 * 4, 0, -4):
        if cols % block == 0:
            return block
    return cols


def quantize_int8(
    weight: torch.Tensor,
    qtype: str = "int8",
    *,
    block: int = INT8_BLOCK,
    chunk_values: int = CHUNK_VALUES,
) -> RowQuant:
    """Symmetric weight-only int8 with one scale per ``block`` inputs of each row (where
    that does not divide a row, the longest block that does, ``_row_block``): scale =
    max|w| / 127, code = round(w / scale) in [-127, 127]; an all-zero block gets scale 1
    (codes 0). Rows go through float32 about ``chunk_values`` weights at a time."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"{qtype}: expected a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    if cols == 0:
        raise ValueError(f"{qtype}: weight has no columns")
    if cols % block:
        block = _row_block(cols)
    codes = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
    scales = torch.empty((rows, cols // block), dtype=torch.float32, device=weight.device)
    step = max(1, chunk_values // cols)
    for start in range(0, rows, step):
        chunk = weight[start : start + step].to(torch.float32)
        blocks = chunk.view(chunk.shape[0], -1, block)
        amax = blocks.abs().amax(dim=2, keepdim=True)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(f"{qtype}: weight has non-finite values")
        scale = amax / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes[start : start + step] = torch.round(blocks / scale).clamp_(-127, 127).view_as(chunk)
        scales[start : start + step] = scale.squeeze(2)
    return RowQuant(codes=codes, scales=scales, offsets=None, block=block, qtype=qtype)
