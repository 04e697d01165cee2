"""Stop conditions checked on the host after each sampled token.

Token-level stops (eos, ``stop_token_ids``, length) are decided from the ids; stop strings
from the incrementally detokenized text. Streamed text is held back while it ends with the
beginning of a stop string, so a stop string is never half-emitted and then trimmed. All of
a request's stop strings are one automaton (``StopMatcher``), fed each new character once: a
step costs the new text's length, however many strings there are. ``StopLimits`` bounds their
number and length, so that building the automaton stays cheap too.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tandem.scheduler.text.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class StopLimits:
    """The most stop strings a request may carry, and the longest one (characters)."""

    max_count: int = 64
    max_length: int = 1024

    def check(self, strings: Sequence[str]) -> None:
        """A ValueError naming the limit passed, and the option that raises it."""
        if len(strings) > self.max_count:
            raise ValueError(
                f"stop: {len(strings)} stop strings, more than the limit of {self.max_count} "
                "(raise it with max_stop_strings, the server's --max-stop-strings)"
            )
        longest = max((len(s) for s in strings), default=0)
        if longest > self.max_length:
            raise ValueError(
                f"stop: a stop string of {longest} characters, longer than the limit of "
                f"{self.max_length} (raise it with max_stop_string_length, the server's "
                "--max-stop-string-length)"
            )


# Sets of stop strings up to this many characters in all have their matcher kept.
_SHARED_CHARS = 4096


class StopMatcher:
    """An Aho-Corasick automaton over a set of stop strings.

    A state is a node of the strings' trie: the longest suffix of the text so far that
    begins some stop string. Its depth is what a stream must hold back; ``ends`` gives,
    for a state, the longest stop string the text now ends with (0 when none).
    """

    def __init__(self, strings: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        ends = [0]
        for s in strings:
            node = 0
            for char in s:
                nxt = goto[node].get(char)
                if nxt is None:
                    nxt = goto[node][char] = len(goto)
                    goto.append({})
                    ends.append(0)
                node = nxt
            ends[node] = max(ends[node], len(s))
        depth = [0] * len(goto)
        fail = [0] * len(goto)
        queue = deque(goto[0].values())  # depth 1: their failure is the root
        for child in queue:
            depth[child] = 1
        while queue:
            node = queue.popleft()
            for char, child in goto[node].items():
                depth[child] = depth[node] + 1
                back = fail[node]
                while back and char not in goto[back]:
                    back = fail[back]
                fail[child] = goto[back].get(char, 0)
                ends[child] = max(ends[child], ends[fail[child]])
                queue.append(child)
        self._goto, self._fail, self._ends, self.depth = goto, fail, ends, depth

    @staticmethod
    def of(strings: tuple[str, ...]) -> StopMatcher:
        """The matcher of ``strings``; small sets are kept and shared by the requests
        that send the same ones (most send a few short strings, often the same)."""
        if sum(map(len, strings)) > _SHARED_CHARS:
            return StopMatcher(strings)
        return _shared_matcher(strings)

    def advance(self, state: int, text: str) -> tuple[int, int | None]:
        """Feed ``text`` from ``state``: the new state, and where the earliest-starting
        stop string that ends inside ``text`` starts, counted back from the end of
        ``text`` (None when none ends there)."""
        goto, fail, ends = self._goto, self._fail, self._ends
        back: int | None = None
        for i, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if ends[state]:
                from_end = len(text) - i - 1 + ends[state]
                back = from_end if back is None else max(back, from_end)
        return state, back


@functools.lru_cache(maxsize=256)
def _shared_matcher(strings: tuple[str, ...]) -> StopMatcher:
    return StopMatcher(strings)


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
    _matcher: StopMatcher | None = field(default=None, repr=False)
    _state: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.stop_strings:
            self._matcher = StopMatcher.of(tuple(self.stop_strings))

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
        if self._matcher is None or self.matched is not None:
            return self.matched
        new = self.text[self._scan_from :]
        self._state, back = self._matcher.advance(self._state, new)
        self._scan_from = len(self.text)
        if back is None:
            return None
        start = len(self.text) - back
        # Of the strings that start there, the first listed (one of them ends there).
        self.matched = next(s for s in self.stop_strings if self.text.startswith(s, start))
        self.text = self.text[:start]
        return self.matched

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
        hold = 0 if self._matcher is None else self._matcher.depth[self._state]
        return len(self.text) - hold


def token_stop(
    token: int, stop_token_ids: Collection[int], eos_ids: Collection[int], ignore_eos: bool
) -> bool:
    """Whether ``token`` ends the request by itself."""
    return token in stop_token_ids or (not ignore_eos and token in eos_ids)
