"""Where the server is in its life: serving, draining after a signal, or given up on a
hung scheduler. The front door, the routes and the shutdown path all read this one
object, so they cannot disagree about whether a new request is welcome."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Lifecycle:
    draining: bool = False
    """SIGTERM or SIGINT arrived: new requests get 503, open ones may finish."""
    hung: str | None = None
    """Why the watchdog gave up on the scheduler (``None`` while it is trusted)."""
    exit_code: int = 0
    """What ``tandem serve`` exits with (non-zero after the watchdog fired)."""
    request_exit: Callable[[], None] = field(default=lambda: None, repr=False)
    """Asks the HTTP server to stop (``tandem serve`` sets it; a no-op otherwise)."""
    stop_starting: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set by a signal that arrives while the engine is still starting: the start is
    abandoned and the server stops without serving."""

    def give_up(self, reason: str) -> None:
        """The watchdog declared the scheduler hung: refuse everything, exit non-zero."""
        self.hung = reason
        self.exit_code = 1
        self.request_exit()

    @property
    def accepting(self) -> bool:
        return not self.draining and self.hung is None
