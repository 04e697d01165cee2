"""When the CPU forward stream tells the host that a batch is done.

On the CPU the host (the scheduler thread) and the "device" (the host stream's worker)
are two Python threads of one process, and Python code runs under one lock, the GIL.
A decode step of a small model on the worker is a stretch of Python (build the batch's
tensors, resolve its input ids, plan attention) and then a forward that runs without
the GIL (the decode trace, or long kernels); the host's work per step (process the
previous batch's tokens, schedule and launch the next one) is Python throughout.

If batch N's copy-done fired when N ends, the host would wake exactly when the worker
starts batch N + 1's Python stretch: the two stretches would take turns on the GIL
and the forward of N + 1 would start only after both, which is the normal loop's
timeline with extra lock traffic. So when batch N + 1 is already queued behind N, the
worker holds N's copy-done and sets it when N + 1 reaches its forward: the host's
Python then runs while the forward runs without the GIL. With nothing queued behind N
(the normal loop, or an idle scheduler) N's copy-done is set when N ends.

Holding is always bounded: a batch's event is held only while a later batch is already
on the stream, and that batch sets every held event before its forward, or when it
ends, whether it succeeded or failed.
"""

from __future__ import annotations

import threading

from tandem.futuremap import Event, Stream


class StepDone(Event):
    """The copy-done event of one CPU batch, set by the forward stream's worker
    (see the module docstring) rather than recorded at a point of the stream."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def record(self, stream: Stream) -> None:
        raise TypeError("a StepDone is set by the forward stream, not recorded")

    def wait(self, stream: Stream) -> None:
        stream.submit(self._done.wait)

    def synchronize(self) -> None:
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()


class Handoff:
    """Sets each CPU batch's ``StepDone`` at the point the module docstring gives.

    ``launch`` is called on the host; ``start``, ``finish`` and ``release`` on the
    forward stream's worker. Each counter is written by one thread only."""

    def __init__(self) -> None:
        self._launched = 0
        self._started = 0
        self._held: list[StepDone] = []

    def launch(self) -> StepDone:
        """A batch is being submitted: its copy-done event."""
        self._launched += 1
        return StepDone()

    def start(self) -> None:
        """A batch began on the worker."""
        self._started += 1

    def release(self) -> None:
        """The running batch reached its forward (or ended): set the held events."""
        held, self._held = self._held, []
        for done in held:
            done.set()

    def finish(self, done: StepDone) -> None:
        """The running batch ended: hold its event when a later batch is queued."""
        self.release()
        if self._launched > self._started:
            self._held.append(done)
        else:
            done.set()
