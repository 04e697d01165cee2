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

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PackedLinear:
    """Several linear layers over the same input as one product, split after."""

    weight: torch.Tensor  # [sum(sizes), in_features]
    bias: torch.Tensor | None  # [sum(sizes)]
    sizes: tuple[int, ...]
    # The same weight reordered into oneDNN's blocked layout (CPU only, see
    # ``with_onednn``), or None; ``dense_up_to``: batches of at most this many tokens
    # still multiply by ``weight``; ``few_rows_up_to``: batches of at most this many
    # take tandem's own product (``with_few_rows``) instead of either.
    onednn: torch.Tensor | None = None
    dense_up_to: int = 0
    few_rows_up_to: int = 0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output, as views of one ``[..., sum(sizes)]`` result."""
        if self.onednn is None:
            y = F.linear(x, self.weight, self.bias)
        elif self.few_rows_up_to:
            y = _cpu_linear_few_rows()(x, self.weight, self.onednn, self.bias, self.few_rows_up_to)
        else:
            y = _cpu_linear()(x, self.weight, self.onednn, self.bias, self.dense_up_to)
        return y.split(self.sizes, dim=-1)


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


def _cpu_linear_few_rows_source(
    x: torch.Tensor,
    weight: torch.Tensor,
    onednn: torch.Tensor,
    bias: torch.Tensor | None,
    few_rows_up_to: int,
) -> torch.Tensor:
    if x.size(0) <= few_rows_up_to:
        return torch.ops.tandem.linear_few_rows(x, weight, bias)
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


@functools.cache
def _cpu_linear_few_rows() -> Callable[..., torch.Tensor]:
    """``_cpu_linear_few_rows_source`` compiled as ``_cpu_linear`` is; only once
    tandem's CPU kernels are registered (TorchScript resolves the op when it compiles)."""
    return _script(_cpu_linear_few_rows_source)


ONEDNN_BATCH_HINT = 32
"""The batch oneDNN's weight layout is chosen for; every batch runs on it."""


ONEDNN_MIN_HIDDEN = 256
"""Smallest hidden size whose CPU projections get oneDNN copies. A oneDNN call costs
more than MKL's to set up, which a tiny model's products do not repay: the embedded
default model (hidden 64) decodes 1.34 times slower with them, a hidden-256 model 0.85
times as long."""


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


@torch.no_grad()
def with_onednn(packed: PackedLinear, forward_threads: int) -> PackedLinear:
    """``packed`` with a copy of its weight in oneDNN's blocked layout, which the CPU
    multiplies without repacking the weight at every call (MKL's ``sgemm`` copies its
    operand into a blocked buffer each time). ``forward_threads``: the forward's
    intra-op threads, which decide where a float32 single token goes (see
    ``dense_up_to``)."""
    weight = packed.weight.contiguous()
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
    dense = dense_up_to(weight.dtype, forward_threads)
    return PackedLinear(packed.weight, packed.bias, packed.sizes, onednn, dense)


def dense_up_to(dtype: torch.dtype, forward_threads: int) -> int:
    """The largest batch that multiplies by the column-major weight instead of the
    oneDNN copy. MKL's float32 matrix-vector product runs on one thread whatever the
    intra-op setting: on one thread it beats oneDNN's, on two oneDNN's splits the
    weight's rows and streams it from memory almost twice as fast (a ~100M-parameter
    model's products for one token: 17.1 against 20.0 ms on one thread, 17.0 against
    13.8 ms on two). bfloat16 is faster on the copy at every batch."""
    return 1 if dtype == torch.float32 and forward_threads == 1 else 0


FEW_ROWS_UP_TO = 2
"""The largest float32 batch that ``with_few_rows`` sends to tandem's own product (the
most it takes). The ~100M benchmark model's products on two threads, per decode step:
11.0 against oneDNN's 13.9 ms for one token, 11.8 against 15.2 for two; from three
tokens on oneDNN's are the faster (12.0 ms at four)."""


def few_rows_available() -> bool:
    """Whether tandem's few-token product is registered: its CPU kernels are loaded
    (``attention.cpu_kernel``) and were built with AVX-512, which the op needs."""
    return hasattr(torch.ops.tandem, "linear_few_rows")


def with_few_rows(packed: PackedLinear) -> PackedLinear:
    """``packed`` multiplying batches of at most ``FEW_ROWS_UP_TO`` tokens with
    ``torch.ops.tandem.linear_few_rows`` (``models/cpu_linear.cpp``), which reads the
    column-major weight once at the rate the machine streams memory; larger batches
    keep the oneDNN copy. Unchanged unless ``packed`` has a oneDNN copy of a float32,
    column-major weight and the op is registered."""
    weight = packed.weight
    column_major = weight.t().is_contiguous()
    if packed.onednn is None or weight.dtype != torch.float32 or not column_major:
        return packed
    if not few_rows_available():
        return packed
    return dataclasses.replace(packed, few_rows_up_to=FEW_ROWS_UP_TO)


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
