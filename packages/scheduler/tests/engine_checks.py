"""Checks the engine tests share."""

from __future__ import annotations

import time
from typing import Any


def idle_clean(engine: Any, timeout_s: float = 30.0) -> None:
    """Strict accounting once the overshoot batch behind the results has landed. Read
    from the test's thread while the loop thread may be between taking a request out
    of scheduling and freeing its row, so it is polled until clean or the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not engine.scheduler.has_work():
                engine.scheduler.check_accounting()
                return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "the scheduler never went idle"
        time.sleep(0.005)
