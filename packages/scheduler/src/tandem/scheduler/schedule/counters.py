"""The scheduler's running figures, reported by ``get_server_info``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    """Figures reported by ``get_server_info``."""

    forward_steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    overshoot_steps: int = 0
    retracted_requests: int = 0
    aborted_requests: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    scheduler_s: float = 0.0
    decode_scheduler_s: float = 0.0
    """The part of ``scheduler_s`` spent in iterations that launched a decode batch
    (one counted in ``decode_steps``), so ``decode_scheduler_s / decode_steps`` is the
    host time per decode step. On the overlap loop such an iteration processes the
    batch before it: the first one of a run processes the last prefill, and the
    iteration that processes the last decode batch launches nothing and is not counted."""
    spec_verify_steps: int = 0
    spec_committed_tokens: int = 0

    @property
    def avg_spec_accept_length(self) -> float:
        """Mean tokens committed per speculative verify step (accepted drafts plus
        the bonus token), SGLang's figure; 0 before any step."""
        if not self.spec_verify_steps:
            return 0.0
        return self.spec_committed_tokens / self.spec_verify_steps
