"""Stop conditions checked on the host after each sampled token.

Token-level stops (eos, ``stop_token_ids``, length) are decided from the ids; stop
strings from the incrementally detokenized text. Streamed text is held back while it
ends with the beginning of a stop string, so a stop string is never half-emitted and
then trimmed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.scheduler.detokenizer import IncrementalDetokenizer


@dataclass
class StopChecker:
    """Per-request text state: detokenizer, accumulated text, emitted offset."""

    stop_strings: list[str]
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    emitted: int = 0
    matched: str | None = None
    _scan_from: int = field(default=0, repr=False)
    _pending: list[int] = field(default_factory=list, repr=False)

    def feed(self, token_ids: list[int]) -> str | None:
        """Add new tokens; return the stop string they completed, if any.

        Without stop strings there is nothing to scan for, so the ids only queue up
        and are decoded when the text is asked for (``take_new_text``) or the request
        ends: a batch call that wants only the final text costs one decode per
        request, not one per token on the scheduler thread."""
        if self.detokenizer is None:
            return None
        if not self.stop_strings:
            self._pending.extend(token_ids)
            return None
        self.text += self.detokenizer.step(token_ids)
        return self._scan()

    def finish_text(self) -> None:
        """The request ended: take what the detokenizer still holds (unless a stop
        string already cut the text)."""
        if self.detokenizer is not None and self.matched is None:
            self._catch_up()
            self.text += self.detokenizer.flush()
            self._scan()

    def _catch_up(self) -> None:
        if self._pending and self.detokenizer is not None:
            pending, self._pending = self._pending, []
            self.text += self.detokenizer.step(pending)

    def _scan(self) -> str | None:
        if not self.stop_strings or self.matched is not None:
            return self.matched
        longest = max(len(s) for s in self.stop_strings)
        start = max(0, self._scan_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop_strings:
            at = self.text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        self._scan_from = len(self.text)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.matched = best[1]
        return best[1]

    def take_new_text(self, final: bool) -> str:
        """Text not yet emitted. Unless ``final``, hold back a tail that could still
        grow into a stop string."""
        self._catch_up()
        end = len(self.text) if final or self.matched else self._safe_end()
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _safe_end(self) -> int:
        hold = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return len(self.text) - hold


def token_stop(
    token: int, stop_token_ids: Collection[int], eos_ids: Collection[int], ignore_eos: bool
) -> bool:
    """Whether ``token`` ends the request by itself."""
    return token in stop_token_ids or (not ignore_eos and token in eos_ids)
