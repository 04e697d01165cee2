"""What the scheduler, the model runner and the engine hand each other, step by step.

scheduler -> runner: a ``ScheduledBatch`` and its ``SamplingInputs`` (plain host data);
runner -> scheduler: a ``LaunchedBatch`` at once, its ``StepResult`` after copy-done;
scheduler -> engine: one ``Update`` per request that produced something or ended.
``Runner`` is all the scheduler knows of the model runner.
docs/concepts/architecture.md follows one request through them.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.futuremap import Event, Work
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.sampling import SamplingBatchInfo, SamplingParams

if TYPE_CHECKING:
    from tandem.scheduler.kv.pools import PagedKVPool, ReqToTokenPool
    from tandem.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class PenaltyReset:
    """A request admitted by this batch: its penalty history starts from these tokens."""

    row: int  # the request's row
    prompt_ids: list[int]  # its prompt
    output_ids: list[int]  # its outputs so far (non-empty after a retraction)
    params: SamplingParams  # its penalties


@dataclass(slots=True)
class GrammarMasks:
    """The token masks of a batch's constrained sampling rows, written by the host
    once each row's request has received every token before this batch, while the
    forward runs; sampling waits for ``ready`` (see ``Scheduler.iterate``)."""

    rows: list[int]  # indices into the batch's sampling rows
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], bit set = allowed
    ready: threading.Event = field(default_factory=threading.Event)
    # A speculative step's masks depend on the tree it drafts: the host hands over the
    # rows' matchers instead (None for a row that ended) and the worker writes them.
    matchers: list[Any] | None = None

    def allow_all(self) -> None:
        """Give up on the masks (the loop died before writing them): nothing waits."""
        self.bitmask.fill_(-1)
        self.ready.set()

    def __reduce__(self) -> tuple[object, ...]:
        # Sent to the other tensor-parallel ranks with its batch: the event as a flag.
        return _masks, (self.rows, self.bitmask, self.ready.is_set())


def _masks(rows: list[int], bitmask: torch.Tensor, ready: bool) -> GrammarMasks:
    masks = GrammarMasks(rows, bitmask)
    if ready:
        masks.ready.set()
    return masks


@dataclass(slots=True)
class ScheduledBatch:
    """One forward, decided on the host from host state alone.

    Per-request columns (``reqs``, ``rows``, ``prefix_lens``, ``extend_lens``) are
    aligned, prefill requests first; the last ``num_decode`` requests are decode rows.
    Per-token columns (``positions``, ``out_cache_loc``) follow the same order, each
    request's ``extend_lens[i]`` tokens contiguous. The scheduler appends to the lists
    while it builds the batch and never touches them after launch.
    """

    mode: ForwardMode  # prefill, decode, mixed (decode rows ride along) or spec_decode
    reqs: list[Request] = field(default_factory=list)  # the requests, in batch order
    rows: list[int] = field(default_factory=list)  # each request's row, frozen at build
    prefix_lens: list[int] = field(default_factory=list)  # tokens already in the KV cache
    extend_lens: list[int] = field(default_factory=list)  # tokens new in this forward
    num_decode: int = 0  # trailing requests whose one token the FutureMap resolves
    prefill_tokens: list[int] = field(default_factory=list)  # prefill tokens, concatenated
    positions: list[int] = field(default_factory=list)  # per new token: its position
    out_cache_loc: list[int] = field(default_factory=list)  # per new token: its KV slot
    table_rows: list[int] = field(default_factory=list)  # req_to_token writes: rows ...
    table_cols: list[int] = field(default_factory=list)  # ... columns (positions) ...
    table_slots: list[int] = field(default_factory=list)  # ... and the slots written there
    sample_indices: list[int] = field(default_factory=list)  # batch indices that sample now
    penalty_resets: list[PenaltyReset] = field(default_factory=list)  # admitted now
    finishing: list[Request] = field(default_factory=list)  # end here without sampling
    next_tokens: list[int] = field(default_factory=list)  # spec prefill: token after chunk
    draft_prefill: bool = False  # spec prefill: the draft reads it (a request here drafts)
    spec_bounds: list[int] = field(default_factory=list)  # spec decode: committed-length bound
    spec_steps: list[int] = field(default_factory=list)  # spec decode: steps launched before
    return_logits: bool = False  # keep the sampled rows' logits (tests, tools)
    grammar: GrammarMasks | None = None  # constrained sampling rows' masks
    # Prebuilt requests (disaggregated decode) to bootstrap before the forward resolves:
    # their rows, first tokens (stashed) and lengths (published).
    prebuilt_rows: list[int] = field(default_factory=list)
    prebuilt_tokens: list[int] = field(default_factory=list)
    prebuilt_lens: list[int] = field(default_factory=list)
    step: int = 0  # the forward step that launched it (names it in the page ledger)
    # Prompt logprobs (``Request.logprob_start_len``): the requests computing some in
    # this forward, how many each (in order), and per logprob the token (an index into
    # the [T] layout) whose logits give it and the prompt token it scores.
    input_logprob_reqs: list[Request] = field(default_factory=list)
    input_logprob_counts: list[int] = field(default_factory=list)
    input_logprob_tokens: list[int] = field(default_factory=list)
    input_logprob_targets: list[int] = field(default_factory=list)
    input_logprob_top: int = 0  # the most top logprobs any of them wants

    def add(
        self, req: Request, start: int, extend: int, slots: list[int], writes: bool = True
    ) -> int:
        """Append ``req`` with ``extend`` new tokens after ``start`` cached ones, mapping
        positions ``start...`` of its row to ``slots``; ``writes``: the new tokens' K/V
        goes to those slots (a speculative row's worker plans its own writes). Returns
        the request's batch index."""
        assert req.row is not None
        self.reqs.append(req)
        self.rows.append(req.row)
        self.prefix_lens.append(start)
        self.extend_lens.append(extend)
        if writes:
            self.out_cache_loc.extend(slots)
        self.map(req.row, start, slots)
        return len(self.reqs) - 1

    def add_input_logprobs(self, req: Request, first_token: int, targets: list[int]) -> None:
        """``req``'s prompt logprobs of ``targets``, each scored by the logits of the token
        before it: the tokens from ``first_token`` (in the [T] layout) on."""
        self.input_logprob_reqs.append(req)
        self.input_logprob_counts.append(len(targets))
        self.input_logprob_tokens.extend(range(first_token, first_token + len(targets)))
        self.input_logprob_targets.extend(targets)
        self.input_logprob_top = max(self.input_logprob_top, req.top_logprobs_num)

    def map(self, row: int, start: int, slots: list[int]) -> None:
        """Point ``row``'s positions ``start...`` at ``slots`` in req_to_token."""
        self.table_rows.extend([row] * len(slots))
        self.table_cols.extend(range(start, start + len(slots)))
        self.table_slots.extend(slots)

    @property
    def sample_rows(self) -> list[int]:
        return [self.rows[i] for i in self.sample_indices]

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    @property
    def sampling_reqs(self) -> list[Request]:
        return [self.reqs[i] for i in self.sample_indices]


@dataclass(frozen=True, slots=True)
class SamplingInputs:
    """Host-side sampling inputs of a batch's sampling rows, frozen at schedule time;
    the runner builds ``SamplingBatchInfo`` from it on the forward stream."""

    params: list[SamplingParams]  # per sampling row
    rows: list[int]  # their rows
    steps: list[int]  # index of the token each samples (keys seeded randomness)
    return_logprob: list[bool]  # whether each wants its token's logprob
    top_logprobs_num: list[int]  # how many top logprobs each wants

    @classmethod
    def of(cls, batch: ScheduledBatch) -> SamplingInputs | None:
        """``batch``'s sampling rows, frozen at launch; None when none samples."""
        reqs = batch.sampling_reqs
        if not reqs:
            return None
        if batch.mode is ForwardMode.SPEC_DECODE:
            steps = list(batch.spec_steps)
        else:
            steps = [r.scheduled_samples - 1 for r in reqs]
        return cls(
            params=[r.params for r in reqs],
            rows=batch.sample_rows,
            steps=steps,
            return_logprob=[r.return_logprob for r in reqs],
            top_logprobs_num=[r.top_logprobs_num for r in reqs],
        )

    @property
    def plain_greedy(self) -> bool:
        """Sampling is an argmax for every row (see ``SamplingBatchInfo``)."""
        return SamplingBatchInfo.is_plain_greedy(
            self.params, self.return_logprob, self.top_logprobs_num
        )

    def build(self, device: torch.device) -> SamplingBatchInfo:
        return SamplingBatchInfo.build(
            self.params,
            rows=self.rows,
            steps=self.steps,
            device=device,
            return_logprob=self.return_logprob,
            top_logprobs_num=self.top_logprobs_num,
        )


@dataclass(slots=True)
class StepResult:
    """One batch's outputs, indexed like ``ScheduledBatch.sample_indices``. Made on the
    device; what ``LaunchedBatch.wait`` returns are host tensors, valid after copy-done."""

    next_token_ids: torch.Tensor  # [S] sampled ids; [S, max_accept] after a spec step
    accept_lens: torch.Tensor | None = None  # spec step: how many of each row's ids count
    logprobs: torch.Tensor | None = None  # [S] logprob of each sampled id
    top_logprob_values: torch.Tensor | None = None  # [S, k] top logprobs ...
    top_logprob_ids: torch.Tensor | None = None  # ... and their ids
    logits: torch.Tensor | None = None  # [S, V] when the batch asked for them
    # Prompt logprobs, in ``ScheduledBatch.input_logprob_targets``' order (None: none).
    input_logprobs: torch.Tensor | None = None  # [N] logprob of each target
    input_top_values: torch.Tensor | None = None  # [N, k] top logprobs ...
    input_top_ids: torch.Tensor | None = None  # ... and their ids


@dataclass(frozen=True, slots=True)
class LaunchedBatch:
    """A batch in flight; the host reads its result only after its copy-done event."""

    batch: ScheduledBatch  # what was scheduled
    work: Work[StepResult]  # yields the host-side result
    copy_done: Event  # set when the result's host copies are complete

    def wait(self) -> StepResult:
        self.copy_done.synchronize()
        return self.work.result()


@dataclass(slots=True)
class Update:
    """What one step produced for one request."""

    req: Request  # the request
    new_ids: list[int] = field(default_factory=list)  # tokens it received this step
    finished: bool = False  # whether it ended this step


class _Collects(Protocol):
    def collect(self) -> None: ...

    def take_steps(self) -> list[tuple[Hashable, float]]: ...


class Runner(Protocol):
    """What the host-only policy needs of the model runner (``runner.ModelRunner``):
    its pools, its vocabulary, and a way to launch a batch and share grammar masks."""

    req_pool: ReqToTokenPool
    kv_pool: PagedKVPool
    vocab_size: int
    masks_wait_on_stream: bool  # the forward stream itself waits for a batch's masks
    timeline: _Collects

    def launch(
        self, batch: ScheduledBatch, sampling: SamplingInputs | None, new_period: bool = False
    ) -> LaunchedBatch: ...

    def discard_rows(self, rows: list[int]) -> None: ...

    def share_masks(self, step: int, bitmask: torch.Tensor) -> None: ...
