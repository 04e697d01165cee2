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
    CPU layout: ``F.linear`` multiplies by ``weight.t()``, which is then a plain
    row-major matrix for the BLAS). Not for a weight shared with another module
    (a tied head): the embedding reads rows, which this layout spreads apart."""
    weight = linear.weight
    packed = _empty_weight(weight.shape[0], weight.shape[1], weight, column_major=True)
    packed.copy_(weight)
    weight.data = packed
