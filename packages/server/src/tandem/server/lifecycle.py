"""Where the server is in its life: serving, draining after a signal, or given up on a
hung scheduler. The front door, the routes and the shutdown path all read this one
object, so they cannot disagree about whether a new request is welcome."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lifecycle:
    draining: bool = False
    """SIGTERM or SIGINT arrived: new requests get 503, open ones may finish."""
    hung: str | None = None
    """Why the watchdog gave up on the scheduler (``None`` while it is trusted)."""
    exit_code: int = 0
    """What ``tandem serve`` exits with (non-zero after the watchdog fired)."""

    @property
    def accepting(self) -> bool:
        return not self.draining and self.hung is None
