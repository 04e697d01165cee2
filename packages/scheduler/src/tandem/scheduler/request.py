"""A request's host-side state: what it asked for, what it holds, what it produced.

The host keeps the truth about lengths here (``kv_len``, ``output_ids``); the device
only ever sees what a batch built from this state tells it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.text.stop import StopChecker


@dataclass
class FinishReason:
    """Why a request ended, in SGLang's ``meta_info["finish_reason"]`` shape."""

    kind: str  # "length" | "stop" | "abort"
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None

    @classmethod
    def abort(cls, message: str) -> FinishReason:
        return cls("abort", message=message)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "length":
            out["length"] = self.length
        elif self.kind == "stop":
            out["matched"] = self.matched
        else:
            out["message"] = self.message
        return out


@dataclass(eq=False)
class Request:
    """One generation request.

    Compared by identity (``eq=False``): the scheduler asks ``req in pool`` every
    step, and a field-by-field ``__eq__`` over token lists made that the largest host
    cost of a decode step.

    ``kv_len`` counts the tokens whose K/V has been scheduled into the cache: the
    prefill advances it chunk by chunk, each decode step by one. ``pages`` are the KV
    pages the request uses (the first ``shared_pages`` of them belong to the radix
    cache, locked through ``prefix_node``); ``row`` its row in the request pool while
    admitted.

    The host runs one step ahead of what it has processed: ``scheduled_samples``
    counts sampling steps launched, ``output_ids`` the tokens received so far, and
    ``in_flight`` the launched batches holding this request whose results the host has
    not processed yet. Its row and pages are released only when ``in_flight`` is 0.

    With speculative decoding a step commits a number of tokens the host learns one
    step late: ``kv_len`` is then an upper bound (each launched step adds the most it
    can commit, processing takes back what it did not), ``spec_committed`` the
    processed truth, ``spec_verify_ct`` the steps processed, ``spec_launched`` the
    steps launched (so ``spec_launched - spec_verify_ct`` are in flight, and while any
    is, ``kv_len`` is only a bound). ``spec_drafts`` says whether the
    draft's state still follows the request: a plain decode step ends that until the
    request is prefilled again (``schedule.spec_policy``).

    Prompt logprobs (``logprob_start_len >= 0``, SGLang's field; -1: none): the logprob
    of each prompt token from ``logprob_start_len`` on given the tokens before it (the
    first prompt token has none: ``None``). Each prefill chunk computes those its
    logits predict; ``input_logprob_next`` is the next prompt position no launched
    chunk has computed yet (host truth at schedule time), ``input_logprobs`` and
    ``input_top_logprobs`` what processing has received. The radix cache may not serve
    a prefix reaching a position still to be computed (``prefix_limit``).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    # Most tokens it may sample: max_new_tokens, capped by the context (set on add).
    max_samples: int = 0
    row: int | None = None
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprob_next: int = 0
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish: FinishReason | None = None
    cached_tokens: int = 0
    # When each output token reached the host (``time.perf_counter``), for requests
    # that asked (``return_token_times``); None otherwise.
    token_times: list[float] | None = None
    scheduled_samples: int = 0
    in_flight: int = 0
    shared_pages: int = 0
    prefix_node: Any = None
    retractions: int = 0
    retracting: bool = False
    admit_seq: int = 0
    fill_ids: list[int] = field(default_factory=list)
    spec_committed: int = 0
    spec_verify_ct: int = 0
    spec_launched: int = 0
    spec_drafts: bool = True
    # Its prefill server's bootstrap address and room (``disagg.Bootstrap``) when it is
    # half of a disaggregated request; None otherwise.
    bootstrap: Any = None
    # Its output constraint's matcher (``grammar.GrammarMatcher``), advanced with each
    # token received; None for free output.
    grammar: Any = None
    # ``params.stop_token_ids`` as a set: checked against every sampled token.
    stop_ids: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids or ())
        if not self.fill_ids:
            self.fill_ids = list(self.prompt_ids)
        start = self.logprob_start_len
        if start < 0:
            self.input_logprob_next = len(self.prompt_ids)  # nothing to compute
        else:
            self.input_logprob_next = max(start, 1)
            if start == 0:  # the first prompt token has no logprob
                self.input_logprobs.append(None)
                if self.top_logprobs_num:
                    self.input_top_logprobs.append(None)

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether it asked for prompt logprobs (``logprob_start_len >= 0``)."""
        return self.logprob_start_len >= 0

    @property
    def input_logprobs_done(self) -> bool:
        """Whether every prompt logprob it asked for has been received."""
        return len(self.input_logprobs) >= len(self.prompt_ids) - max(self.logprob_start_len, 0)

    @property
    def prefix_limit(self) -> int:
        """The most tokens of ``fill_ids`` the radix cache may serve: all but the last
        (the model runs on at least one token), and none from the position before the
        next prompt logprob to compute (its logits must be computed)."""
        limit = len(self.fill_ids) - 1
        if self.input_logprob_next < len(self.prompt_ids):
            limit = min(limit, self.input_logprob_next - 1)
        return max(limit, 0)

    @property
    def prefill_done(self) -> bool:
        """Whether every token to prefill (the prompt, or after a retraction the
        prompt and the outputs so far) has been scheduled."""
        return self.kv_len >= len(self.fill_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None


@dataclass(eq=False)
class Stages:
    """Where each admitted or queued request is. A request moves
    waiting -> prefilling -> running -> retiring, and from retiring back to waiting
    when it was retracted; it is in at most one list at a time."""

    waiting: deque[Request] = field(default_factory=deque)  # queued, no row yet
    prefilling: list[Request] = field(default_factory=list)  # prompt not fully scheduled
    running: list[Request] = field(default_factory=list)  # decoding
    retiring: list[Request] = field(default_factory=list)  # left, a batch still in flight
    # Disaggregated decode: holding a row and pages while its prompt's KV comes.
    transferring: list[Request] = field(default_factory=list)

    def admitted(self) -> int:
        """Requests holding a row."""
        return (
            len(self.prefilling) + len(self.running) + len(self.retiring) + len(self.transferring)
        )
