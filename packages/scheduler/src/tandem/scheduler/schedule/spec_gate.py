"""Whether drafting pays, measured: speculative decoding's gate.

A speculative step over ``n`` requests takes ``t_spec(n)`` and commits ``a`` tokens a
request; a plain step takes ``t_plain(n)`` and commits one: drafting pays while
``a * t_plain(n) > t_spec(n)``. Per size class of ``n`` (1, 2-3, 4-7, ...) the gate keeps
the latest forward times of both kinds (``Timeline.steps``), and ``drafts(n)`` says:
draft until speculation is measured; then one plain step to measure plain decoding
(once a class: it leaves its requests' drafts behind); then the measured gain decides.
A losing class measures speculation again after ``REPROBE_AFTER`` plain steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_STEPS = 8
"""Forward times of a kind a class needs before they count."""
KEEP_STEPS = 16
"""Forward times of a kind a class keeps (their median is its estimate)."""
KEEP_COMMITS = 256
"""Request-steps whose committed tokens make the accept length."""
REPROBE_AFTER = 1024
"""Plain steps of a losing class before it measures speculation again."""


@dataclass
class _SizeClass:
    spec_s: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP_STEPS))
    plain_s: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP_STEPS))
    plain_since_spec: int = 0


@dataclass
class SpecGate:
    """Measured step times and accept length; ``drafts(n)`` says whether a step over
    ``n`` decoding requests drafts."""

    min_steps: int = MIN_STEPS
    reprobe_after: int = REPROBE_AFTER
    classes: dict[int, _SizeClass] = field(default_factory=dict)
    commits: deque[int] = field(default_factory=lambda: deque(maxlen=KEEP_COMMITS))

    def _of(self, n: int) -> _SizeClass:
        return self.classes.setdefault(max(n, 1).bit_length(), _SizeClass())

    def step_timed(self, speculative: bool, n: int, seconds: float) -> None:
        """A decode forward over ``n`` requests took ``seconds``."""
        size = self._of(n)
        if speculative:
            size.spec_s.append(seconds)
            size.plain_since_spec = 0
            return
        size.plain_s.append(seconds)
        size.plain_since_spec += 1
        if size.plain_since_spec >= self.reprobe_after and not self._wins(size):
            size.spec_s.clear()  # the next requests that can draft measure it again
            size.plain_since_spec = 0

    def committed(self, accepted: int) -> None:
        """A request's speculative step committed ``accepted`` tokens."""
        self.commits.append(accepted)

    @property
    def accept_length(self) -> float | None:
        """Tokens a request commits per speculative step, over the latest ones."""
        return sum(self.commits) / len(self.commits) if self.commits else None

    def gain(self, n: int) -> float | None:
        """Speculative over plain output tokens/s at ``n`` requests, once both kinds
        of step are measured there; else None."""
        return self._gain(self._of(n))

    def _gain(self, size: _SizeClass) -> float | None:
        accept = self.accept_length
        if accept is None or min(len(size.spec_s), len(size.plain_s)) < self.min_steps:
            return None
        return accept * statistics.median(size.plain_s) / statistics.median(size.spec_s)

    def _wins(self, size: _SizeClass) -> bool:
        gain = self._gain(size)
        return gain is None or gain > 1.0

    def summary(self) -> dict[str, object]:
        """What the gate measured, for ``get_server_info``: the accept length, and per
        size class (named by its smallest batch) the median step times and the gain."""
        classes: dict[str, object] = {}
        for bits, size in sorted(list(self.classes.items())):  # the scheduler may add one
            spec_s, plain_s = list(size.spec_s), list(size.plain_s)
            classes[str(1 << (bits - 1))] = {
                "drafting_s": statistics.median(spec_s) if spec_s else None,
                "plain_s": statistics.median(plain_s) if plain_s else None,
                "gain": self._gain(size),
            }
        return {"accept_length": self.accept_length, "classes": classes}

    def drafts(self, n: int) -> bool:
        """Whether a step over ``n`` decoding requests should draft."""
        size = self._of(n)
        if len(size.spec_s) < self.min_steps:
            return True
        if len(size.plain_s) < self.min_steps:
            return False
        return self._wins(size)
