"""The scheduler's side of speculative decoding, in one place.

A speculative step commits 1 to ``max_accept`` tokens and the host learns how many
one step late, so ``Request.kv_len`` is an upper bound: launching adds
``max_accept``, processing takes back what was not committed (``spec_committed`` is
the processed truth). docs/concepts/overlap-loop.md explains why a step reserves KV
``lookahead`` positions past that bound. From ``batch_limit`` decoding requests on,
or where the measured ``SpecGate`` says drafting loses, decoding is plain (``drafts``).
"""

from __future__ import annotations

from collections.abc import Hashable

from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.kv.resources import Resources
from tandem.scheduler.messages import ScheduledBatch
from tandem.scheduler.request import Request, Stages
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.spec_gate import SpecGate


class SpecPolicy:
    """Speculative rows, their commits, the bound they keep on ``kv_len``, and when
    speculation turns off."""

    def __init__(
        self,
        max_accept: int,
        lookahead: int,
        resources: Resources,
        counters: Counters,
        batch_limit: int | None = None,
        gate: SpecGate | None = None,
    ) -> None:
        self.max_accept = max_accept
        self.lookahead = lookahead
        self.resources = resources
        self.counters = counters
        self.batch_limit = batch_limit
        self.gate = gate

    def drafts(self, decodable: list[Request]) -> bool | None:
        """Whether the next decode step over ``decodable`` is speculative (True): while
        fewer than ``batch_limit`` requests decode, all of them with a draft state that
        follows them, and the ``gate`` (if any) finds that drafting pays. Otherwise the
        step is plain (False), which leaves the draft behind (it would need the
        target's features at the positions decoded plainly): that request decodes
        plainly to its end, and requests admitted later draft again.

        A plain step needs each request's exact length, so no speculative step of
        theirs may be in flight (launched, not yet processed). Past the batch limit
        it never is: the decoding requests only grow in number through a prefill
        step, and both loops process the step before a prefill before they schedule
        the step after it. The gate, though, turns drafting off between two decode
        steps: then the answer is None, no step yet, and the overlap loop lands the
        step in flight before it schedules the plain one (one step without overlap,
        once per switch)."""
        n = len(decodable)
        may = self._may_draft(n, decodable)
        if may and self._pays(n):
            return True
        open_steps = [req.rid for req in decodable if req.spec_launched > req.spec_verify_ct]
        if open_steps and may:
            return None
        if open_steps:
            raise RuntimeError(f"a plain step over requests with a step in flight: {open_steps}")
        return False

    def schedule(self, decodable: list[Request]) -> ScheduledBatch | None:
        """One speculative row per decodable request that gets its KV.

        The step starts from the true committed length ``L <= bound`` (the device
        resolves it from the FutureMap) and writes KV at ``[L, L + lookahead)``, so
        every position below ``bound + lookahead`` is reserved and mapped first:
        whatever the step in flight commits, this one writes only into pages its
        request holds. Rejected positions are overwritten by a later step.
        """
        batch = ScheduledBatch(ForwardMode.SPEC_DECODE)
        for req in decodable:
            bound = req.kv_len
            end = bound + self.lookahead
            if not self.resources.reserve(req, end):
                continue
            slots = self.resources.kv_pool.slots(req.pages, bound, end)
            batch.sample_indices.append(batch.add(req, bound, self.max_accept, slots, False))
            batch.spec_bounds.append(bound)
            batch.spec_steps.append(req.spec_launched)
            req.kv_len = bound + self.max_accept
            req.scheduled_samples += 1  # a step yields at least one token
            req.spec_launched += 1
        return batch if batch.reqs else None

    def steps_timed(self, steps: list[tuple[Hashable, float]]) -> None:
        """Decode forwards the forward stream timed, keyed ``(speculative, rows)``."""
        if self.gate is not None:
            for (speculative, n), seconds in steps:  # type: ignore[misc]
                self.gate.step_timed(speculative, n, seconds)

    @staticmethod
    def decoded_plainly(batch: ScheduledBatch) -> None:
        """``batch``, a plain decode step, leaves its requests' draft state behind."""
        for req in batch.reqs:
            req.spec_drafts = False

    def admitted(self, reqs: list[Request], stages: Stages) -> None:
        """Requests admitted now draft only if their first decode step would: fewer
        than ``batch_limit`` requests running and prefilling, all of them drafting, and
        the gate finding that drafting pays there. Those that will not skip the draft's
        work over their prompt (their draft KV stays unwritten, as after a plain step)."""
        n = len(stages.running) + len(stages.prefilling)
        drafts = self._may_draft(n, stages.running) and self._pays(n)
        for req in reqs:
            req.spec_drafts = drafts

    def _may_draft(self, n: int, reqs: list[Request]) -> bool:
        """Below the batch limit at ``n`` requests, and ``reqs`` all drafting."""
        few = self.batch_limit is None or n < self.batch_limit
        return few and all(req.spec_drafts for req in reqs)

    def _pays(self, n: int) -> bool:
        return self.gate is None or self.gate.drafts(n)

    def prefilled(self, batch: ScheduledBatch, req: Request, end: int) -> None:
        """A prefill chunk ending at ``end``: the draft reads the chunk shifted by one,
        so it needs the token after it (a sampling request's sampled token replaces
        this on the device); a batch with no drafting request skips the draft."""
        batch.next_tokens.append(req.fill_ids[min(end, len(req.fill_ids) - 1)])
        batch.draft_prefill |= req.spec_drafts
        req.spec_committed = end

    def commit(self, req: Request, tokens: list[int], accepted: int) -> list[int]:
        """A processed step committed ``accepted`` of ``tokens``: the bound shrinks to
        the truth. Returns the committed tokens."""
        req.spec_verify_ct += 1
        req.spec_committed += accepted
        req.kv_len -= self.max_accept - accepted
        req.scheduled_samples += accepted - 1
        self.counters.spec_verify_steps += 1
        self.counters.spec_committed_tokens += accepted
        if self.gate is not None:
            self.gate.committed(accepted)
        return tokens[:accepted]

    @staticmethod
    def committed_plainly(req: Request) -> None:
        """A processed plain decode step committed one token."""
        req.spec_committed += 1

    @staticmethod
    def truth(req: Request) -> None:
        """Before freeing: positions past the processed truth hold rejected or
        overshoot KV, which must not go into the radix cache."""
        req.kv_len = req.spec_committed
