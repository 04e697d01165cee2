"""The loop thread's admission window, over a scheduler that only records what each step
was given: a burst that wakes an idle loop is taken whole, the window closes when
requests stop coming (aborts do not hold it open) or after its span, a busy loop never
waits, and stop ends a window."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.engine.delivery import Waiter
from tandem.scheduler.engine.loop import ADMISSION_WINDOW_SPAN, EngineLoop


@dataclass
class _Req:
    rid: str


@dataclass
class _Scheduler:
    """Each ``iterate`` launches whatever has been added since the last one."""

    busy_steps: int = 0
    """Steps to run after each launch, and before the first (requests decoding)."""
    queued: list[str] = field(default_factory=list)
    steps: list[tuple[float, list[str]]] = field(default_factory=list)
    left: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def has_work(self) -> bool:
        return bool(self.queued) or self.left > 0

    def has_requests(self) -> bool:
        return self.has_work()

    def waits_on_peers(self) -> bool:
        return False

    def add(self, req: _Req) -> None:
        self.queued.append(req.rid)

    def abort(self, rid: str) -> None:
        pass

    def iterate(self) -> list[Any]:
        with self.lock:
            if self.queued:
                self.left = self.busy_steps
            else:
                self.left -= 1
            self.steps.append((time.monotonic(), self.queued))
            self.queued = []
        time.sleep(0.001)
        return []

    def abandon_masks(self) -> None:
        pass

    def launches(self) -> list[list[str]]:
        with self.lock:
            return [rids for _, rids in self.steps if rids]


def _add(loop: EngineLoop, rid: str) -> float:
    loop.add(Waiter(_Req(rid)))  # type: ignore[arg-type]
    return time.monotonic()


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


@pytest.fixture
def make_loop() -> Any:
    loops: list[EngineLoop] = []

    def make(window_s: float, busy_steps: int = 0) -> tuple[EngineLoop, _Scheduler]:
        scheduler = _Scheduler(busy_steps=busy_steps, left=busy_steps)
        loop = EngineLoop(scheduler, speculative=False, admission_window_s=window_s)  # type: ignore[arg-type]
        loops.append(loop)
        return loop, scheduler

    yield make
    for loop in loops:
        loop.stop()


def test_a_burst_that_wakes_an_idle_loop_is_launched_as_one_step(make_loop: Any) -> None:
    loop, scheduler = make_loop(window_s=1.0)
    for i in range(3):
        _add(loop, f"r{i}")
        time.sleep(0.05)  # far apart for a thread, well within the window
    _wait_for(lambda: scheduler.launches())
    assert scheduler.launches() == [["r0", "r1", "r2"]]


def test_without_a_window_the_first_request_is_launched_alone(make_loop: Any) -> None:
    loop, scheduler = make_loop(window_s=0.0)
    _add(loop, "r0")
    _wait_for(lambda: scheduler.launches())
    _add(loop, "r1")
    _wait_for(lambda: len(scheduler.launches()) == 2)
    assert scheduler.launches() == [["r0"], ["r1"]]


def test_a_lone_request_waits_one_window(make_loop: Any) -> None:
    window = 0.2
    loop, scheduler = make_loop(window_s=window)
    sent = _add(loop, "r0")
    _wait_for(lambda: scheduler.launches())
    launched = scheduler.steps[0][0]
    assert launched - sent >= window
    assert scheduler.launches() == [["r0"]]


def test_the_window_closes_after_its_span_while_requests_keep_coming(make_loop: Any) -> None:
    window = 0.05
    loop, scheduler = make_loop(window_s=window)
    first = _add(loop, "r0")
    sent = 1
    # One request every fifth of a window, for three spans.
    while time.monotonic() - first < 3 * ADMISSION_WINDOW_SPAN * window:
        time.sleep(window / 5)
        _add(loop, f"r{sent}")
        sent += 1
    _wait_for(lambda: sum(map(len, scheduler.launches())) == sent)
    launches = scheduler.launches()
    assert len(launches) > 1, "the window never closed"
    assert launches[0][0] == "r0"
    assert len(launches[0]) < sent


def test_aborts_do_not_hold_the_window_open(make_loop: Any) -> None:
    window = 0.5
    loop, scheduler = make_loop(window_s=window)
    sent = _add(loop, "r0")
    # Aborts of unknown ids, a fifth of a window apart, for the whole span.
    while time.monotonic() - sent < ADMISSION_WINDOW_SPAN * window:
        loop.abort("gone")
        time.sleep(window / 5)
    _wait_for(lambda: scheduler.launches())
    launched = scheduler.steps[0][0]
    assert window <= launched - sent < 0.75 * ADMISSION_WINDOW_SPAN * window


def test_a_busy_loop_takes_new_requests_at_its_next_step(make_loop: Any) -> None:
    window = 5.0
    loop, scheduler = make_loop(window_s=window, busy_steps=1_000_000)
    begin = _add(loop, "r0")
    _wait_for(lambda: scheduler.launches())
    _add(loop, "r1")
    _wait_for(lambda: len(scheduler.launches()) == 2)
    assert time.monotonic() - begin < window  # no window: the loop was not idle
    assert scheduler.launches() == [["r0"], ["r1"]]


def test_stop_ends_a_window(make_loop: Any) -> None:
    loop, scheduler = make_loop(window_s=30.0)
    waiter = Waiter(_Req("r0"))  # type: ignore[arg-type]
    loop.add(waiter)
    time.sleep(0.05)
    begin = time.monotonic()
    loop.stop()
    assert time.monotonic() - begin < 10.0
    assert scheduler.launches() == []
    error = waiter.chunks.get(timeout=1)
    assert isinstance(error, RuntimeError)


@pytest.mark.parametrize("bad", [-1, -0.5, 1001, float("nan"), float("inf"), True, "4"])
def test_admission_window_ms_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="admission_window_ms"):
        EngineConfig.from_options({"admission_window_ms": bad})
