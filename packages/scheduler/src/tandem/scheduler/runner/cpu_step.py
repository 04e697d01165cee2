"""How a step runs on the CPU: the ``ModelRunner``'s step driver for the host stream.

The forward stream is the host stream's worker thread and the step's outputs are host
tensors already, so there is no copy: the worker sets each batch's copy-done event
itself (``StepDone``), at the point ``Handoff`` picks so that the host's Python runs
beside a forward rather than beside the next batch's preparation. A decode step that
continues its decode stage replays the ``DecodeTrace``. Each forward runs on the
intra-op threads ``ForwardThreads`` gives its number of tokens. Why, and what each
costs: docs/concepts/overlap-loop.md, "The CPU forward stream".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.futuremap import Event, Stream
from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.forward_batch import ForwardBatch
from tandem.scheduler.messages import LaunchedBatch, ScheduledBatch, StepResult
from tandem.scheduler.models import CausalLM
from tandem.scheduler.runner.decode_trace import DecodeTrace
from tandem.scheduler.runner.step_inputs import StepInputs


@dataclass(frozen=True)
class ForwardThreads:
    """Intra-op threads of the CPU forward, step by step: ``short`` for a step of fewer
    than ``long_from_tokens`` tokens, ``long`` from there on.

    A step's matrix products grow with its tokens; the host's work beside it barely
    does. A short step is a chain of short calls as long as the host's Python, and runs
    best on one core fewer, which leaves the scheduler thread a core of its own; a long
    one is long products that every core shortens, beside which the host's work is a
    small share (``wiring.default_forward_threads`` draws the line)."""

    short: int
    long: int
    long_from_tokens: int = 1

    def __post_init__(self) -> None:
        if self.short < 1 or self.long < 1 or self.long_from_tokens < 1:
            raise ValueError(f"ForwardThreads needs positive counts, got {self}")

    @classmethod
    def fixed(cls, threads: int) -> ForwardThreads:
        """``threads`` for every step."""
        return cls(threads, threads)

    def for_tokens(self, tokens: int) -> int:
        """The threads of a step of ``tokens`` tokens."""
        return self.long if tokens >= self.long_from_tokens else self.short


class StepDone(Event):
    """The copy-done event of one CPU batch, set by the forward stream's worker
    (see ``Handoff``) rather than recorded at a point of the stream."""

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
    """Sets each CPU batch's ``StepDone``: when the batch ends if nothing is queued
    behind it or it failed, else when the batch behind it reaches its forward (or ends,
    failed or not), so an event is held only while a later batch is on the stream.

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

    def finish(self, done: StepDone, hold: bool = True) -> None:
        """The running batch ended: hold its event when a later batch is queued (and
        ``hold``: a failed batch never holds, since the host stream skips the batches
        queued behind a failure and none of them would set it)."""
        self.release()
        if hold and self._launched > self._started:
            self._held.append(done)
        else:
            done.set()


class CpuStep:
    """The step driver of the CPU (see ``model_runner.StepDriver``)."""

    def __init__(
        self,
        stream: Stream,
        model: CausalLM,
        attention: AttentionBackend,
        decode_trace: DecodeTrace | None,
        threads: ForwardThreads | None = None,
    ) -> None:
        self.stream = stream
        self.model = model
        self.attention = attention
        self.decode_trace = decode_trace
        self.threads = threads
        self.handoff = Handoff()
        self._threads_set: int | None = None  # the worker's setting, written there only
        if threads is not None:
            # Before any step: the worker's first parallel op makes its OpenMP pool.
            stream.submit(self._set_threads, 1).result()

    def launch(self, batch: ScheduledBatch, run: Callable[[], StepResult]) -> LaunchedBatch:
        done = self.handoff.launch()
        return LaunchedBatch(batch, self.stream.submit(self._run, run, done), done)

    def _run(self, run: Callable[[], StepResult], done: StepDone) -> StepResult:
        """On the worker: the step, then its copy-done handed over."""
        self.handoff.start()
        try:
            result = run()
        except BaseException:
            self.handoff.finish(done, hold=False)
            raise
        self.handoff.finish(done)
        return result

    def _set_threads(self, tokens: int) -> None:
        """On the worker: its intra-op threads for a step of ``tokens`` tokens (a
        per-thread setting, so the host's threads keep theirs)."""
        if self.threads is None:
            return
        threads = self.threads.for_tokens(tokens)
        if threads != self._threads_set:
            torch.set_num_threads(threads)
            self._threads_set = threads

    def forward_starts(self) -> None:
        """The step's preparation is over: the host's work now runs beside it."""
        self.handoff.release()

    def replay(self, batch: ScheduledBatch, inputs: StepInputs) -> torch.Tensor | None:
        """No whole-step replay on the CPU (the decode trace replays the model's
        forward only, after planning: see ``forward``)."""
        return None

    def forward(
        self, fb: ForwardBatch, capture: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The model's forward of the planned batch, on the threads its tokens call for:
        replayed by the decode trace when the step is one it covers, else eager."""
        self.handoff.release()  # the host's work now runs beside this forward
        self._set_threads(fb.input_ids.shape[0])
        if self.decode_trace is not None and not capture:
            hidden = self.decode_trace.forward(fb)
            if hidden is not None:
                return hidden, []
        return self.model.forward_capture(fb.input_ids, fb.positions, self.attention, capture)
