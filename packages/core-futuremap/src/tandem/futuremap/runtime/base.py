"""The device-runtime interface every layer above programs against.

A ``Stream`` is an ordered queue of device work; an ``Event`` marks a point
in one. CUDA/HIP streams and the CPU host stream implement the same two classes, so the
overlap loop is written once and runs, for real, on both.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class StreamError(RuntimeError):
    """Work enqueued on a stream failed; raised at the host's next wait on that stream."""


class Work(Generic[T]):
    """The handle of one callable submitted to a stream.

    ``result`` returns the callable's return value. On a device stream the
    callable ran on the host at submission (it only *enqueued* kernels), so the value is
    available at once but tensors in it may still be in flight: wait on an event
    recorded after the work before reading their contents on the host. On the host
    stream the callable runs on the worker thread, so ``result`` blocks until it
    has run.
    """

    def __init__(self, on_raise: Callable[[BaseException], None] | None = None) -> None:
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        # Called with the error this handle raises, so a stream can count it as
        # reported (raised once at a host wait, not again at the next synchronize).
        self._on_raise = on_raise

    @classmethod
    def completed(cls, value: T) -> Work[T]:
        """A handle whose callable has already run and returned ``value``."""
        work: Work[T] = cls()
        work._finish(value, None)
        return work

    def _finish(self, value: T | None, error: BaseException | None) -> None:
        self._value = value
        self._error = error
        self._done.set()

    def done(self) -> bool:
        """Whether the callable has run (successfully or not)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the callable and return its value, or raise what it raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"work not finished after {timeout} s")
        if self._error is not None:
            if self._on_raise is not None:
                self._on_raise(self._error)
            raise StreamError(f"work on the stream failed: {self._error!r}") from self._error
        return self._value  # type: ignore[return-value]


class Event(ABC):
    """A point in a stream's order.

    Events are created unrecorded; an unrecorded event counts as complete (CUDA's
    semantics), so waiting on it is a no-op.
    """

    @abstractmethod
    def record(self, stream: Stream) -> None:
        """Mark the current tail of ``stream``: the event completes once all work
        enqueued on ``stream`` before this call has run."""

    @abstractmethod
    def wait(self, stream: Stream) -> None:
        """Make work enqueued on ``stream`` after this call wait for the event. The
        host does not block."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event completes; raise a pending stream error."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the event has completed, without blocking."""


class Stream(ABC):
    """An ordered queue of device work.

    ``submit`` enqueues a callable in stream order: on CUDA/HIP it runs at once under
    the stream's context (its kernels are what is queued), on the CPU host stream it
    runs on the worker thread. Either way the code inside is written as if it were on
    the device: no host reads of device results.
    """

    device: torch.device

    @abstractmethod
    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Work[T]:
        """Run ``fn(*args, **kwargs)`` in stream order."""

    @abstractmethod
    def new_event(self) -> Event:
        """A fresh, unrecorded event of this stream's kind (created lazily on
        devices: no driver object exists until the first record)."""

    def record_event(self) -> Event:
        """A new event recorded at the stream's current tail."""
        event = self.new_event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event``."""
        event.wait(self)

    def wait_stream(self, other: Stream) -> None:
        """Later work on this stream waits for everything enqueued on ``other`` so far."""
        other.record_event().wait(self)

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all enqueued work has run; raise a pending error."""
