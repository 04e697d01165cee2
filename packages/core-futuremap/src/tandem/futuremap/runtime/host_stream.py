"""The CPU host stream: one worker thread that runs enqueued callables in order.

torch releases the GIL inside its kernels, so a forward running on the worker overlaps
with scheduling on the main thread, for real, on a CPU. ``HostEvent``s are sequence
numbers in the stream. An exception raised by an item becomes the stream's pending
error: items queued behind it are skipped, and the host's next wait on the stream
re-raises it as a ``StreamError``, so it is never lost and never turns into a hang.
See docs/concepts/futuremap.md, "HostStream".
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tandem.futuremap.runtime.base import Event, Stream, StreamError, Work

T = TypeVar("T")

_worker_local = threading.local()


@dataclass
class _Item:
    seq: int
    fn: Callable[[], Any] | None  # None: stop the worker
    work: Work[Any]


@dataclass
class _State:
    """Everything the worker thread touches; it holds no reference to the
    ``HostStream`` handle, so an abandoned stream is collected and its worker
    stopped."""

    max_delay_s: float
    rng: random.Random
    cond: threading.Condition = field(default_factory=threading.Condition)
    queue: deque[_Item] = field(default_factory=deque)
    submitted: int = 0  # sequence number of the last enqueued item
    completed: int = 0  # sequence number of the last finished item
    pending_error: BaseException | None = None
    closed: bool = False
    thread: threading.Thread | None = None

    def reached(self, seq: int) -> bool:
        return self.completed >= seq

    def wait_until(self, seq: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.completed >= seq or self.thread_dead())

    def thread_dead(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def acknowledge(self, error: BaseException) -> None:
        """``error`` was raised to the host by a ``Work.result``: it is reported."""
        with self.cond:
            if self.pending_error is error:
                self.pending_error = None

    def raise_pending(self) -> None:
        with self.cond:
            error, self.pending_error = self.pending_error, None
        if error is not None:
            raise StreamError(f"host stream work failed: {error!r}") from error


def _run_worker(state: _State, owner: weakref.ref[HostStream]) -> None:
    _worker_local.owner = owner
    _worker_local.state = state
    while True:
        with state.cond:
            state.cond.wait_for(lambda: bool(state.queue))
            item = state.queue.popleft()
            skip = state.pending_error is not None
        if item.fn is None:
            with state.cond:
                state.completed = item.seq
                state.cond.notify_all()
            return
        if state.max_delay_s > 0:
            time.sleep(state.rng.uniform(0.0, state.max_delay_s))
        value: Any = None
        error: BaseException | None = None
        if skip:
            error = StreamError("skipped: an earlier item on this host stream failed")
        else:
            try:
                value = item.fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced at the next host wait
                error = exc
        with state.cond:
            if error is not None and not skip and state.pending_error is None:
                state.pending_error = error
            state.completed = item.seq
            state.cond.notify_all()
        item.work._finish(value, error)


def _close_state(state: _State) -> None:
    # Also runs at interpreter exit (weakref.finalize's atexit): the worker must have
    # stopped before torch's thread pools are torn down, or the process aborts.
    with state.cond:
        if not state.closed:
            state.closed = True
            state.submitted += 1
            state.queue.append(_Item(state.submitted, None, Work()))
            state.cond.notify_all()
    thread = state.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


class HostStream(Stream):
    """A FIFO stream of Python callables run by one worker thread.

    Args:
        name: the worker thread's name (shows up in profilers and ``py-spy``).
        max_delay_s: opt-in random delay before each item, in ``[0, max_delay_s]``;
            a test mode that shakes out ordering bugs. ``0`` disables it.
        seed: seed of those delays, for reproducible shaking.
    """

    def __init__(
        self, name: str = "tandem-host-stream", *, max_delay_s: float = 0.0, seed: int | None = None
    ) -> None:
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        self.device = torch.device("cpu")
        self.name = name
        self._state = _State(max_delay_s=max_delay_s, rng=random.Random(seed))
        thread = threading.Thread(
            target=_run_worker, args=(self._state, weakref.ref(self)), name=name, daemon=True
        )
        self._state.thread = thread
        thread.start()
        self._finalizer = weakref.finalize(self, _close_state, self._state)

    # -- Stream -------------------------------------------------------------------
    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Work[T]:
        state = self._state
        work: Work[T] = Work(on_raise=state.acknowledge)
        with state.cond:
            if state.closed:
                raise RuntimeError(f"host stream {self.name!r} is closed")
            state.submitted += 1
            state.queue.append(_Item(state.submitted, lambda: fn(*args, **kwargs), work))
            state.cond.notify_all()
        return work

    def new_event(self) -> HostEvent:
        return HostEvent()

    def wait_event(self, event: Event) -> None:
        if isinstance(event, HostEvent) and event._state is self._state:
            return  # FIFO: everything before the event already runs first
        self.submit(_block_on, event)

    def synchronize(self) -> None:
        state = self._state
        with state.cond:
            target = state.submitted
        if self.on_worker():
            raise RuntimeError("synchronize() called from the stream's own worker would deadlock")
        state.wait_until(target)
        state.raise_pending()

    # -- host-stream specifics ------------------------------------------------------
    def on_worker(self) -> bool:
        """Whether the calling thread is this stream's worker."""
        return threading.current_thread() is self._state.thread

    @property
    def pending(self) -> int:
        """Items submitted but not yet finished."""
        with self._state.cond:
            return self._state.submitted - self._state.completed

    def close(self) -> None:
        """Run what is queued, then stop the worker. Submitting afterwards raises."""
        self._finalizer()

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostStream(name={self.name!r}, pending={self.pending})"


def _block_on(event: Event) -> None:
    if isinstance(event, HostEvent):
        event._block_until_reached()
    else:
        event.synchronize()


class HostEvent(Event):
    """A sequence number in a ``HostStream`` (or a ready point of an
    ``InlineStream``).

    Recorded from the host, the event marks the stream's current tail. Recorded from
    inside a work item (on the worker, as ``FutureMap.publish`` does), everything before
    that point has already run, so the event is complete at once; a host that wants to
    wait for a point inside a later item records its event itself, after ``submit``.
    """

    def __init__(self) -> None:
        self._state: _State | None = None
        self._target = 0

    def record(self, stream: Stream) -> None:
        if isinstance(stream, InlineStream):
            self._state, self._target = None, 0
            return
        if not isinstance(stream, HostStream):
            raise TypeError(f"a HostEvent records on a host stream, not {type(stream).__name__}")
        state = stream._state
        with state.cond:
            self._target = state.completed if stream.on_worker() else state.submitted
        self._state = state

    def wait(self, stream: Stream) -> None:
        stream.wait_event(self) if isinstance(stream, HostStream) else self.synchronize()

    def _block_until_reached(self) -> None:
        if self._state is not None:
            self._state.wait_until(self._target)

    def synchronize(self) -> None:
        state = self._state
        if state is None:
            return
        if state.thread is threading.current_thread():
            if not state.reached(self._target):
                raise RuntimeError(
                    "waiting on a later point of the same host stream would deadlock"
                )
            return
        state.wait_until(self._target)
        state.raise_pending()

    def query(self) -> bool:
        return self._state is None or self._state.reached(self._target)


class InlineStream(Stream):
    """The calling thread itself, used as a stream: ``submit`` runs the callable at
    once and exceptions propagate directly. What ``current_stream`` returns on a
    CPU thread that is no host stream's worker (the normal loop, plain scripts)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Work[T]:
        return Work.completed(fn(*args, **kwargs))

    def new_event(self) -> HostEvent:
        return HostEvent()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        return None


def current_host_stream() -> Stream:
    """The host stream whose worker is calling, or an ``InlineStream``."""
    owner_ref: weakref.ref[HostStream] | None = getattr(_worker_local, "owner", None)
    owner = owner_ref() if owner_ref is not None else None
    return owner if owner is not None else InlineStream()
