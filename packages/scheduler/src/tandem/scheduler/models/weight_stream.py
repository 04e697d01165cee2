"""The weight stream: a thread that reads a short step's quantized weights just ahead of
its products, on the core the step leaves free (``kernels/cpu_stream.cpp``).

A decode step of a request or two runs on one core fewer than the machine has
(``engine.wiring.default_forward_threads``) and reads every weight once; one core alone
keeps too few reads in flight to stream them at the machine's rate. The stream is
opened over a model's quantized products in the order a step calls them, and each
product of fewer than ``rows_below`` rows tells it where the step is. It never changes
a result.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.scheduler.models.quant_panels import QuantPanels

WINDOW_BYTES = 4 << 20
"""How far ahead of the running product the stream reads: about two layers of the
default model, well inside the last-level cache."""


@dataclass(frozen=True)
class WeightStreamStats:
    """``lines_read``: cache lines the stream read; ``short_products`` and
    ``long_products``: products of its weights in short steps (which it reads ahead of)
    and in long ones (which it leaves alone)."""

    lines_read: int
    short_products: int
    long_products: int


def available() -> bool:
    """Whether this process's CPU kernels have the weight stream."""
    return hasattr(torch.ops.tandem, "weight_stream_open")


class WeightStream:
    """An open weight stream over ``products`` (see the module docstring); ``close``
    stops its thread and lets the weights go."""

    def __init__(
        self, products: Sequence[QuantPanels], rows_below: int, window_bytes: int = WINDOW_BYTES
    ) -> None:
        tensors: list[torch.Tensor] = []
        firsts: list[int] = []
        for panels in products:
            firsts.append(len(tensors))
            tensors += panels.tensors
        self.rows_below = rows_below
        self._handle: int = torch.ops.tandem.weight_stream_open(
            tensors, firsts, window_bytes, rows_below
        )
        # Closed when dropped unclosed, at the latest at exit.
        self._closer = weakref.finalize(self, torch.ops.tandem.weight_stream_close, self._handle)

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def stats(self) -> WeightStreamStats:
        """What the stream has done so far (zeros once closed)."""
        if self.closed:
            return WeightStreamStats(0, 0, 0)
        lines, short, long = torch.ops.tandem.weight_stream_stats(self._handle)
        return WeightStreamStats(lines, short, long)

    def close(self) -> None:
        """Stop the stream's thread (idempotent)."""
        self._closer()
