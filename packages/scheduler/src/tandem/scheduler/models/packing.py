"""Inference weight layouts: fused projections, and column-major weights on the CPU.

Applied once, after the weights are loaded and placed (``CausalLM.pack``): q/k/v (and
gate/up) run as one ``PackedLinear`` product over their stacked weights, one call
instead of three (or two), and on the CPU each weight is stored column-major
(``make_column_major``), which its BLAS multiplies faster for decode-sized inputs.
Parameters keep their checkpoint names and shapes, as views into the packed storage.
Packing comes last: moving the model (``.to``) afterwards would separate the
parameters from what the forward reads. See docs/guides/adding-a-model.md.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.scheduler.kernels import cpu_build

if TYPE_CHECKING:
    from tandem.scheduler.models.quant_panels import QuantPanels


@dataclass(frozen=True)
class PackedLinear:
    """Several linear layers over the same input as one product, split after."""

    weight: torch.Tensor  # [sum(sizes), in_features]
    bias: torch.Tensor | None  # [sum(sizes)]
    sizes: tuple[int, ...]
    # The same weight reordered into oneDNN's blocked layout (CPU only, see
    # ``with_onednn``), or None; ``dense_up_to``: batches of at most this many tokens
    # still multiply by ``weight``.
    onednn: torch.Tensor | None = None
    dense_up_to: int = 0
    # The same weight in panels (``to_panels``) for tandem's own product (float32 or
    # bfloat16), which then takes every batch (``with_panels``), or None.
    panels: torch.Tensor | None = None
    # Whether the CPU multiplies this weight by a copy in a blocked layout (a layer at
    # least ``ONEDNN_MIN_HIDDEN`` wide, ``with_onednn``): oneDNN's, where oneDNN takes
    # the dtype, and panels in its place where tandem's product does.
    blocked: bool = False
    # The weight kept quantized (``models.quantized.pack_quantized``): one panel set per
    # run of layers with one code layout, in order; ``weight`` is then an empty stand-in.
    quant: tuple[QuantPanels, ...] = ()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output, as views of one ``[..., sum(sizes)]`` result."""
        if len(self.quant) == 1:
            y = self.quant[0](x, self.bias)
        elif self.quant:
            y = torch.cat([part(x) for part in self.quant], dim=-1)
            y = y if self.bias is None else y + self.bias
        elif self.panels is not None:
            y = torch.ops.tandem.linear_panels(x, self.panels, self.bias, sum(self.sizes))
        elif self.onednn is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = _cpu_linear()(x, self.weight, self.onednn, self.bias, self.dense_up_to)
        return y.split(self.sizes, dim=-1)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` for a single layer. tandem's product adds the residual
        as it stores each sum (after rounding it, where ``+`` would add), one pass
        instead of a product and an add: a layer's output projection and down
        projection (measurements: docs/benchmarks.md, Measurements behind the code)."""
        if len(self.sizes) != 1:
            raise ValueError(f"plus takes a single layer, not {len(self.sizes)} stacked")
        if self.quant and residual.dtype == x.dtype and residual.is_contiguous():
            return self.quant[0](x, self.bias, residual)
        if self.panels is not None and residual.dtype == x.dtype and residual.is_contiguous():
            y: torch.Tensor = torch.ops.tandem.linear_panels(
                x, self.panels, self.bias, self.sizes[0], residual
            )
            return y
        return residual + self(x)[0]


def _cpu_linear_source(
    x: torch.Tensor,
    weight: torch.Tensor,
    onednn: torch.Tensor,
    bias: torch.Tensor | None,
    dense_up_to: int,
) -> torch.Tensor:
    if x.size(0) <= dense_up_to:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")


def _script(source: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    with warnings.catch_warnings():
        # torch 2.13 deprecates TorchScript; see decode_trace for why it is still used.
        warnings.filterwarnings("ignore", r"`torch\.jit\.script", DeprecationWarning)
        return torch.jit.script(source)  # type: ignore[no-any-return]


@functools.cache
def _cpu_linear() -> Callable[..., torch.Tensor]:
    """``_cpu_linear_source`` compiled by TorchScript, once per process. The decode
    trace records a call to it as one node (it could not record the oneDNN op's empty
    list of optional scalars), and the batch-size test stays a test at every replay
    instead of the branch taken when the trace was recorded."""
    return _script(_cpu_linear_source)


ONEDNN_BATCH_HINT = 32
"""The batch oneDNN's weight layout is chosen for; every batch runs on it."""


ONEDNN_MIN_HIDDEN = 256
"""Smallest hidden size whose CPU projections get oneDNN copies. A oneDNN call costs
more than MKL's to set up, which a tiny model's products do not repay: the embedded
default model (hidden 64) decodes slower with them, a hidden-256 model faster
(measurements: docs/benchmarks.md, Measurements behind the code)."""


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN multiplies ``dtype`` on this CPU: every CPU build of torch has
    it for float32; bfloat16 and float16 need instructions some CPUs lack (bfloat16:
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT), and copying a weight for them fails there."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


@torch.no_grad()
def with_onednn(packed: PackedLinear, forward_threads: int) -> PackedLinear:
    """``packed`` marked ``blocked``, with a copy of its weight in oneDNN's blocked
    layout where oneDNN takes its dtype (``onednn_available``), which the CPU
    multiplies without repacking the weight at every call (MKL's ``sgemm`` copies its
    operand into a blocked buffer each time). ``forward_threads``: the forward's
    intra-op threads, which decide where a float32 single token goes (see
    ``dense_up_to``)."""
    weight = packed.weight.contiguous()
    if not onednn_available(weight.dtype):  # panels may still take its place
        return PackedLinear(packed.weight, packed.bias, packed.sizes, blocked=True)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
    dense = dense_up_to(weight.dtype, forward_threads)
    return PackedLinear(packed.weight, packed.bias, packed.sizes, onednn, dense, blocked=True)


def dense_up_to(dtype: torch.dtype, forward_threads: int) -> int:
    """The largest batch that multiplies by the column-major weight instead of the
    oneDNN copy. MKL's float32 matrix-vector product runs on one thread whatever the
    intra-op setting: on one thread it beats oneDNN's, on two oneDNN's splits the
    weight's rows and streams it from memory faster. bfloat16 is faster on the copy at
    every batch (measurements: docs/benchmarks.md, Measurements behind the code)."""
    return 1 if dtype == torch.float32 and forward_threads == 1 else 0


PANEL_COLUMNS = 48
"""Output columns per panel of ``to_panels``: the width ``kernels/cpu_linear.cpp`` reads."""


def panels_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether tandem's product is registered for ``dtype``: its CPU kernels are loaded
    (``kernels.cpu_build``) and were built with AVX2 and FMA or with AVX-512, which
    the op needs for float32, and for bfloat16 (``cpu_build.bf16_panels``)."""
    if not hasattr(torch.ops.tandem, "linear_panels"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_build.bf16_panels())


@torch.no_grad()
def to_panels(weight: torch.Tensor, halves: bool | None = None) -> torch.Tensor:
    """A ``[out, in]`` weight in panels of ``PANEL_COLUMNS`` output columns, zero past
    ``out``, contiguous, so that a product reads each panel in address order.

    float32: ``[ceil(out / PANEL_COLUMNS), in, PANEL_COLUMNS]``, panel ``p`` being
    columns ``p * PANEL_COLUMNS`` onwards of ``weight.t()``. With ``halves`` (default:
    where the kernels are the AVX2 build, ``cpu_build.panel_halves``, whose tiles read
    24 columns at a time, and the only layout that build's op takes):
    ``[ceil(out / PANEL_COLUMNS), 2, in, PANEL_COLUMNS // 2]``, each panel's first half
    of its columns for every input, then its second. bfloat16:
    ``[ceil(out / PANEL_COLUMNS), ceil(in / 2), 2 * PANEL_COLUMNS]``, the same columns
    by pairs of inputs: row ``j`` of a panel holds each column's weights for inputs
    ``2j`` and ``2j + 1`` side by side (zero for an odd ``in``'s last), the operand
    order of AVX512_BF16's pairwise dot product."""
    rows, cols = weight.shape
    count = -(-rows // PANEL_COLUMNS)
    if weight.dtype != torch.bfloat16:
        padded = weight.new_zeros(count * PANEL_COLUMNS, cols)
        padded[:rows].copy_(weight)
        if cpu_build.panel_halves() if halves is None else halves:
            half = PANEL_COLUMNS // 2
            return padded.view(count, 2, half, cols).transpose(2, 3).contiguous()
        return padded.view(count, PANEL_COLUMNS, cols).transpose(1, 2).contiguous()
    pairs = -(-cols // 2)
    padded = weight.new_zeros(count * PANEL_COLUMNS, 2 * pairs)
    padded[:rows, :cols].copy_(weight)
    by_pair = padded.view(count, PANEL_COLUMNS, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return by_pair.view(count, pairs, 2 * PANEL_COLUMNS)


def with_panels(packed: PackedLinear) -> PackedLinear:
    """``packed`` multiplying every batch with ``torch.ops.tandem.linear_panels``
    (``kernels/cpu_linear.cpp``) over a copy of its weight in panels, in place of its
    oneDNN copy (which it drops). In float32 that is faster than oneDNN at decode
    batches and as fast or faster for a prefill with AVX-512; with AVX2 faster at small
    batches, level at 64 tokens and a little slower for a long prefill. In bfloat16 on
    an AVX2 CPU, where oneDNN cannot multiply it, the panels take the place of torch's
    own product, which is far slower (measurements: docs/benchmarks.md, Measurements
    behind the code). Unchanged unless ``packed`` is ``blocked`` and the op takes its
    dtype here."""
    weight = packed.weight
    if not packed.blocked or not panels_available(weight.dtype):
        return packed
    return PackedLinear(weight, packed.bias, packed.sizes, panels=to_panels(weight), blocked=True)


def _empty_weight(rows: int, cols: int, like: torch.Tensor, column_major: bool) -> torch.Tensor:
    """An uninitialized ``[rows, cols]`` matrix in ``like``'s dtype and device."""
    if column_major:
        return torch.empty((cols, rows), dtype=like.dtype, device=like.device).t()
    return torch.empty((rows, cols), dtype=like.dtype, device=like.device)


@torch.no_grad()
def pack_linears(linears: Sequence[nn.Linear], column_major: bool) -> PackedLinear:
    """Stack ``linears`` (same input size, all with or all without bias) into one
    ``PackedLinear``; each layer's weight and bias become views of the stacked ones."""
    first = linears[0].weight
    if any(linear.in_features != linears[0].in_features for linear in linears):
        raise ValueError("pack_linears: the layers read inputs of different sizes")
    with_bias = [linear.bias is not None for linear in linears]
    if any(with_bias) != all(with_bias):
        raise ValueError("pack_linears: some layers have a bias and some do not")
    sizes = tuple(linear.out_features for linear in linears)
    weight = _empty_weight(sum(sizes), linears[0].in_features, first, column_major)
    bias = first.new_empty(sum(sizes)) if all(with_bias) else None
    start = 0
    for linear, size in zip(linears, sizes, strict=True):
        weight[start : start + size].copy_(linear.weight)
        linear.weight.data = weight[start : start + size]
        if bias is not None and linear.bias is not None:
            bias[start : start + size].copy_(linear.bias)
            linear.bias.data = bias[start : start + size]
        start += size
    return PackedLinear(weight, bias, sizes)


@torch.no_grad()
def make_column_major(linear: nn.Linear) -> None:
    """Store ``linear``'s weight column-major, in place of its row-major storage (the
    CPU layout: ``F.linear`` multiplies by ``weight.t()``, which is then a plain
    row-major matrix for the BLAS). Not for a weight shared with another module
    (a tied head): the embedding reads rows, which this layout spreads apart."""
    weight = linear.weight
    packed = _empty_weight(weight.shape[0], weight.shape[1], weight, column_major=True)
    packed.copy_(weight)
    weight.data = packed
