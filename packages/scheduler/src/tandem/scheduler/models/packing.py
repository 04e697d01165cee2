"""Inference weight layouts: fused projections, and column-major weights on the CPU.

Applied once, after the weights are loaded and placed (``CausalLM.pack``):

- **Fused projections.** q/k/v (and gate/up) read the same input, so they run as one
  matrix product over their weights stacked along the output dimension, then split:
  one call instead of three (or two). A small model's decode step is counted in calls;
  on an accelerator each call is a kernel launch.
- **Column-major on the CPU.** ``F.linear(x, w)`` multiplies by ``w.t()``; when ``w``
  is stored column-major, ``w.t()`` is a plain row-major matrix, which the CPU's BLAS
  multiplies 1.3x to 3.5x faster for decode-sized inputs (16 rows: 28 -> 10 us for a
  64 x 352 weight, 182 -> 50 us for a 64 x 2304 head) and no slower for prefill-sized
  ones. Accelerators keep the row-major layout.

The parameters keep their checkpoint names and shapes: each becomes a view into the
packed storage, so ``state_dict``, ``named_parameters`` and a later ``copy_`` into a
parameter see the model as before and write through to what the forward reads.
Packing must come last: moving the model (``.to``) afterwards would copy the
parameters apart from their packed storage, and the forward would read stale weights.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output, as views of one ``[..., sum(sizes)]`` result."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


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
    CPU layout, see the module docstring). Not for a weight shared with another module
    (a tied head): the embedding reads rows, which this layout spreads apart."""
    weight = linear.weight
    packed = _empty_weight(weight.shape[0], weight.shape[1], weight, column_major=True)
    packed.copy_(weight)
    weight.data = packed
