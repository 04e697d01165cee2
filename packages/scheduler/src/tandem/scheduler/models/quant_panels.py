"""Quantized weights laid out for tandem's product (``kernels/cpu_quant.cpp``).

A weight in row form (``quant_rows.RowQuant``: codes with a scale, and for 4-bit codes
an offset, per block of each row's inputs) is repacked once, at load, into panels of
``PANEL_COLUMNS`` output columns, its scales and offsets beside them, in the layout the
kernel's int8 dot products read in address order (``QuantPanels``). The embedding reads
its rows from the same panels, so a tied head and embedding share one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # quant_rows brings the gguf library, slow to import
    from tandem.scheduler.models.quant_rows import RowQuant

PANEL_COLUMNS = 48
"""Output columns per panel: the width ``kernels/cpu_quant.cpp`` reads."""


@dataclass(frozen=True)
class QuantPanels:
    """A ``[out_features, in_features]`` weight in quantized panels.

    ``codes``: for each panel of 48 output columns, code rows of each column's codes
    for 4 inputs side by side: 4-bit codes of inputs 8j..8j+3 in the low nibbles and
    8j+4..8j+7 in the high ones, ``[P, in / 8, 192]``; 8-bit codes of inputs 4j..4j+3
    plus 128, ``[P, in / 4, 192]``, both uint8. ``scales`` and ``offsets`` (4-bit codes
    only): ``[P, in / block, 48]``, float16 where every one of them is exact in it (a
    Q4_1 weight then holds the 20 bytes per 32 inputs of its file), else float32;
    columns past ``out_features`` are zero.
    ``qtype``: the source's type name (``Q4_1``, ``int8``), for messages and memory
    reports.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    block: int
    out_features: int
    in_features: int
    qtype: str
    # x's 8-bit parts in the int8 products: 2 (an error of 1 / 65,000 of each
    # block's largest value) or 1 (llama.cpp's rounding, half the work); see the kernel.
    parts: int = 2

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds, in the order a product reads it: codes, scales, offsets."""
        parts = (self.codes, self.scales, self.offsets)
        return tuple(t for t in parts if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __call__(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias) (+ residual)`` in ``x``'s dtype; the product runs in
        float32, so other dtypes are widened for it and the result rounded once."""
        dtype = x.dtype
        if dtype != torch.float32:
            x = x.float()
            bias = None if bias is None else bias.float()
            residual = None if residual is None else residual.float()
        y: torch.Tensor = torch.ops.tandem.linear_quant(
            x, self.codes, self.scales, self.offsets, self.block, bias, self.out_features,
            residual, self.parts,
        )  # fmt: skip
        return y if dtype == torch.float32 else y.to(dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``index`` (any shape), dequantized to float32: an
        embedding's lookup, ``[*index.shape, in_features]``."""
        flat = index.reshape(-1)
        panel, column = flat // PANEL_COLUMNS, flat % PANEL_COLUMNS
        four = self.offsets is not None
        rows = self.codes.shape[1]
        quads = self.codes.view(-1, rows, PANEL_COLUMNS, 4)[panel, :, column]  # [n, rows, 4]
        if four:
            values = torch.stack((quads & 15, quads >> 4), dim=2).flatten(1)
        else:
            values = quads.flatten(1).to(torch.int16) - 128
        values = values.float()
        blocks = self.scales[panel, :, column].float().repeat_interleave(self.block, dim=1)
        out = values * blocks
        if self.offsets is not None:
            offsets = self.offsets[panel, :, column].float()
            out += offsets.repeat_interleave(self.block, dim=1)
        return out.view(*index.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in float32, ``[out_features, in_features]``."""
        return self.rows(torch.arange(self.out_features, device=self.codes.device))


def exact_in_half(values: torch.Tensor) -> bool:
    """Whether every value is float16's exactly (GGUF's Q4_0, Q4_1 and Q8_0 blocks store
    their scales in float16; K-quants' are products of two, int8's float32)."""
    return bool(torch.equal(values.half().float(), values))


@torch.no_grad()
def to_quant_panels(weight: RowQuant, parts: int = 2) -> QuantPanels:
    """``weight`` (row form) repacked into panels, multiplied by x in ``parts``; see
    ``QuantPanels``."""
    rows, cols = weight.codes.shape
    count = -(-rows // PANEL_COLUMNS)
    padded = weight.codes.new_zeros(count * PANEL_COLUMNS, cols)
    padded[:rows].copy_(weight.codes)
    by_panel = padded.view(count, PANEL_COLUMNS, cols)
    if weight.codes.dtype == torch.uint8:  # octets: inputs 8j..8j+3 low, 8j+4..8j+7 high
        octets = by_panel.view(count, PANEL_COLUMNS, cols // 8, 2, 4)
        packed = octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)  # [P, 48, in / 8, 4]
        codes = packed.permute(0, 2, 1, 3).reshape(count, cols // 8, 4 * PANEL_COLUMNS)
    else:  # quads of inputs, each code plus 128
        biased = (by_panel.to(torch.int16) + 128).to(torch.uint8)
        quads = biased.view(count, PANEL_COLUMNS, cols // 4, 4).permute(0, 2, 1, 3)
        codes = quads.reshape(count, cols // 4, 4 * PANEL_COLUMNS)

    def per_block(values: torch.Tensor) -> torch.Tensor:
        blocks = values.float().new_zeros(count * PANEL_COLUMNS, values.shape[1])
        blocks[:rows].copy_(values)
        return blocks.view(count, PANEL_COLUMNS, -1).transpose(1, 2).contiguous()

    offsets = None if weight.offsets is None else per_block(weight.offsets)
    scales = per_block(weight.scales)
    if all(exact_in_half(t) for t in (scales, offsets) if t is not None):
        scales = scales.half()
        offsets = None if offsets is None else offsets.half()
    return QuantPanels(codes, scales, offsets, weight.block, rows, cols, weight.qtype, parts)
