"""A batch as the schedule side builds it: plain host data, no device reads.

The model runner turns it into device tensors on the forward stream. Everything the
forward needs is decided here from host-side truth (request lengths, KV pages), so
the schedule side never waits for the device to build the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.request import Request
from tandem.scheduler.sampling import SamplingParams


@dataclass(frozen=True)
class PenaltyReset:
    """A request admitted in this batch: its penalty history starts from these
    tokens (its outputs too, when it comes back after a retraction)."""

    row: int
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams


@dataclass
class ScheduledBatch:
    """One forward, decided on the host.

    Attributes:
        mode: prefill, decode, or mixed (a prefill with decode rows riding along).
        reqs: the requests, in batch order (prefill requests first when mixed).
        prefix_lens: per request, tokens already in the KV cache.
        extend_lens: per request, tokens new in this forward.
        prefill_tokens: the prefill requests' new tokens, concatenated (host data).
        decode_rows: rows whose single new token is resolved from the FutureMap.
        positions: per new token, its position in its sequence.
        out_cache_loc: per new token, its KV slot.
        table_rows: req_to_token entries to write, flat: their rows ...
        table_cols: ... their columns (token positions) ...
        table_slots: ... and the KV slots written there.
        sample_indices: batch indices of the requests that sample a token now (a
            prefill chunk that does not end the prompt samples nothing).
        penalty_resets: requests admitted now whose penalty state must be reset.
        return_logits: keep the sampled rows' logits in the result (tests, tools).
        rows: each request's row, snapshotted when the batch is built, so the
            forward reads host data frozen at schedule time, never live request state
            the host keeps changing while the batch waits on the forward stream.
        finishing: requests that end with this batch without sampling (a prefill with
            ``max_new_tokens == 0``).
        next_tokens: speculative prefill only: per request, the token after its chunk
            (the next prompt token; for a request that samples now, the sampled token
            replaces it on the device), so the draft can run over the chunk shifted.
        spec_bounds: speculative decode only: per request, an upper bound of its
            committed length when the step starts.
        spec_steps: speculative decode only: per request, steps it launched before.
        step: the forward step that launched it (``Counters.forward_steps``), which
            names it in the page ledger's messages.
    """

    mode: ForwardMode
    reqs: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]
    prefill_tokens: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    out_cache_loc: list[int] = field(default_factory=list)
    table_rows: list[int] = field(default_factory=list)
    table_cols: list[int] = field(default_factory=list)
    table_slots: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    penalty_resets: list[PenaltyReset] = field(default_factory=list)
    return_logits: bool = False
    rows: list[int] = field(default_factory=list)
    finishing: list[Request] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)
    spec_bounds: list[int] = field(default_factory=list)
    spec_steps: list[int] = field(default_factory=list)
    step: int = 0

    @property
    def sample_rows(self) -> list[int]:
        return [self.rows[i] for i in self.sample_indices]

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    @property
    def sampling_reqs(self) -> list[Request]:
        return [self.reqs[i] for i in self.sample_indices]
