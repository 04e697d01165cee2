"""Checks the engine tests share."""

from __future__ import annotations

import time
from typing import Any


def idle_clean(engine: Any, timeout_s: float = 30.0) -> None:
    """Strict accounting once the scheduler is idle: a result reaches the caller before
    the overshoot batch behind it is processed, so wait for that first."""
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.has_work():
        assert time.monotonic() < deadline, "the scheduler never went idle"
        time.sleep(0.005)
    engine.scheduler.check_accounting()
