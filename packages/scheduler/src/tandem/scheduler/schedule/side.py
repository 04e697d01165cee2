"""What the scheduler asks of a disaggregation side (``disagg.PrefillSide`` or
``disagg.DecodeSide``): one set of hooks, each a no-op on the side it does not concern,
so that the policy never imports the transfer machinery."""

from __future__ import annotations

from typing import Protocol

from tandem.scheduler.messages import ScheduledBatch, Update
from tandem.scheduler.request import Request


class Side(Protocol):
    holds_arrivals: bool
    """Whether an admitted request waits here (for its KV) rather than in the queue."""

    def add(self, req: Request) -> Update | None:
        """Take a request with a bootstrap; an update ends it at once (refused)."""

    def abort(self, rid: str) -> Update | None:
        """End ``rid`` if it is held here; None when it is not."""

    def ended(self, req: Request) -> None:
        """``req`` ended in the scheduler before its KV left (aborted)."""

    def has_work(self) -> bool: ...

    def poll(self) -> list[Update]:
        """What peers answered since the last step."""

    def attach(self, batch: ScheduledBatch) -> None:
        """Join arrived requests to ``batch``, the next launched."""

    def prefilled(self, updates: list[Update]) -> list[Update]:
        """Hold the updates that must wait for a transfer; the rest pass."""

    def close(self) -> None: ...
