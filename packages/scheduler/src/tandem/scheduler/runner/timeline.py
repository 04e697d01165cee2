"""Busy and idle time of the forward stream, the figures that show the overlap working.

``device_busy_s`` sums the time the forward stream spent running forwards;
``device_idle_s`` sums the gaps between consecutive forwards *within a busy period*:
time the device waited for the host. On the CPU the host stream's worker times each
forward with its own clock; on an accelerator, timing events are read back lazily,
once the host has waited for the batch anyway (docs/concepts/overlap-loop.md, "How
busy and idle time are measured"). A forward begun with a ``key`` also leaves its own
seconds in ``steps``, which speculative decoding's gate reads (``take_steps``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Marks:
    start: Any
    end: Any
    new_period: bool
    key: Hashable | None


@dataclass
class Timeline:
    """Accumulates busy/idle seconds of one forward stream."""

    device: torch.device
    busy_s: float = 0.0
    idle_s: float = 0.0
    _last_end: Any = field(default=None, init=False, repr=False)
    _stalled: float = field(default=0.0, init=False, repr=False)
    _pending: list[_Marks] = field(default_factory=list, init=False, repr=False)
    # Keyed forwards' (key, seconds), appended on the forward stream, taken on the host.
    steps: deque[tuple[Hashable, float]] = field(default_factory=deque, init=False, repr=False)

    # -- called on the forward stream -----------------------------------------------
    def begin(self, new_period: bool, key: Hashable | None = None) -> Any:
        """Mark a forward's start; returns the handle ``end`` takes. A forward with a
        ``key`` leaves ``(key, seconds)`` in ``steps``."""
        if self.device.type == "cpu":
            start = time.perf_counter()
            if self._last_end is not None and not new_period:
                self.idle_s += start - self._last_end
            return (start, new_period, key)
        event = torch.get_device_module(self.device).Event(enable_timing=True)
        event.record()
        return (event, new_period, key)

    def end(self, handle: Any) -> None:
        """Mark the end of the forward ``begin`` returned ``handle`` for."""
        start, new_period, key = handle
        if self.device.type == "cpu":
            self._last_end = time.perf_counter()
            busy = self._last_end - start - self._stalled
            self.busy_s += busy
            self.idle_s += self._stalled
            self._stalled = 0.0
            if key is not None:
                self.steps.append((key, busy))
            return
        event = torch.get_device_module(self.device).Event(enable_timing=True)
        event.record()
        self._pending.append(_Marks(start, event, new_period, key))

    def stall(self, seconds: float) -> None:
        """On the CPU's forward stream: the running forward waited ``seconds`` for the
        host (a batch's grammar masks), which counts as idle, not busy."""
        self._stalled += seconds

    # -- called on the host, after the batch's copy-done ------------------------------
    def collect(self) -> None:
        """Fold in accelerator timings whose events have completed."""
        while self._pending and self._pending[0].end.query():
            marks = self._pending.pop(0)
            busy = marks.start.elapsed_time(marks.end) / 1000.0
            self.busy_s += busy
            if marks.key is not None:
                self.steps.append((marks.key, busy))
            if self._last_end is not None and not marks.new_period:
                self.idle_s += max(0.0, self._last_end.elapsed_time(marks.start) / 1000.0)
            self._last_end = marks.end

    def take_steps(self) -> list[tuple[Hashable, float]]:
        """The keyed forwards timed since the last call, oldest first."""
        steps = self.steps
        return [steps.popleft() for _ in range(len(steps))]

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0
