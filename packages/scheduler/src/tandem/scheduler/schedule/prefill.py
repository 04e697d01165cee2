"""Admission and chunked prefill: which waiting requests get a row, and how much of
each prompt the next prefill batch carries."""

from __future__ import annotations

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.kv.resources import Resources
from tandem.scheduler.messages import PenaltyReset, ScheduledBatch
from tandem.scheduler.request import Request, Stages
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.spec_policy import SpecPolicy


class PrefillManager:
    """Builds prefill batches: chunked prompts continue first, then waiting requests
    are admitted while the token budget, the rows and the KV pages allow."""

    def __init__(
        self,
        config: EngineConfig,
        stages: Stages,
        resources: Resources,
        counters: Counters,
        spec: SpecPolicy | None,
    ) -> None:
        self.stages = stages
        self.resources = resources
        self.counters = counters
        self.spec = spec
        self.budget = config.max_prefill_tokens
        self.chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else 1 << 62
        self.max_running = config.max_running_requests
        self.longest_prefix_first = config.schedule_policy == "lpm" and resources.radix is not None
        self._admissions = 0

    def schedule(self, decoding: int) -> ScheduledBatch | None:
        """The next prefill batch, keeping a page for each of ``decoding`` requests."""
        budget = self.budget
        chosen: list[tuple[Request, int]] = []
        for req in self.stages.prefilling:
            if budget <= 0:
                break
            n = min(len(req.fill_ids) - req.kv_len, self.chunk, budget)
            if not self.resources.reserve(req, req.kv_len + n):
                break
            chosen.append((req, n))
            budget -= n
        admitted = self._admit(chosen, budget, decoding)
        if not chosen:
            return None
        return self._build(chosen, admitted)

    def _admit(self, chosen: list[tuple[Request, int]], budget: int, reserve: int) -> list[Request]:
        """Admit waiting requests into ``chosen`` while ``budget`` tokens, the rows and
        the pages (after ``reserve`` kept for decoding) allow."""
        self._order_waiting()
        waiting = self.stages.waiting
        room = self.max_running - self.stages.admitted()
        admitted: list[Request] = []
        while waiting and budget > 0 and room > 0:
            req = waiting[0]
            if len(req.fill_ids) > min(budget, self.chunk) and chosen:
                break  # a prompt that must be chunked starts a batch of its own
            if not self.resources.admit(req, self.chunk, reserve):
                break
            waiting.popleft()
            self._admitted(req)
            admitted.append(req)
            n = min(len(req.fill_ids) - req.kv_len, self.chunk, budget)
            if not self.resources.reserve(req, req.kv_len + n):
                raise RuntimeError(f"admitted request {req.rid} has no KV for its first chunk")
            chosen.append((req, n))
            budget -= n
            room -= 1
        return admitted

    def _admitted(self, req: Request) -> None:
        if req.retractions == 0:
            req.cached_tokens = req.kv_len
            self.counters.cached_tokens += req.kv_len
        self._admissions += 1
        req.admit_seq = self._admissions
        self.stages.prefilling.append(req)

    def _order_waiting(self) -> None:
        """``lpm``: longest cached prefix first (stable among equals)."""
        waiting = self.stages.waiting
        if not self.longest_prefix_first or len(waiting) < 2:
            return
        cached = self.resources.cached_prefix
        scored = sorted(enumerate(waiting), key=lambda item: (-cached(item[1]), item[0]))
        waiting.clear()  # in place: others hold the queue
        waiting.extend(req for _, req in scored)

    def _build(self, chosen: list[tuple[Request, int]], admitted: list[Request]) -> ScheduledBatch:
        batch = ScheduledBatch(ForwardMode.PREFILL)
        slots = self.resources.kv_pool.slots
        if self.spec is not None and admitted:
            self.spec.admitted(admitted, self.stages)
        for req in admitted:
            assert req.row is not None
            batch.penalty_resets.append(
                PenaltyReset(req.row, req.prompt_ids, list(req.output_ids), req.params)
            )
            if req.kv_len > 0:  # the cached prefix: the new row must point at its slots
                batch.map(req.row, 0, slots(req.pages, 0, req.kv_len))
        for req, n in chosen:
            start, end = req.kv_len, req.kv_len + n
            index = batch.add(req, start, n, slots(req.pages, start, end))
            if req.input_logprob_next < len(req.prompt_ids):
                _input_logprobs(batch, req, len(batch.prefill_tokens), start, end)
            batch.prefill_tokens.extend(req.fill_ids[start:end])
            batch.positions.extend(range(start, end))
            if self.spec is not None:
                self.spec.prefilled(batch, req, end)
            req.kv_len = end
            if req.prefill_done:
                self._prefilled(batch, req, index)
        return batch

    def _prefilled(self, batch: ScheduledBatch, req: Request, index: int) -> None:
        """``req``'s last chunk is in ``batch``: it samples its first token there and
        decodes from the next batch on, or ends without sampling."""
        self.stages.prefilling.remove(req)
        if req.retractions == 0:
            self.counters.prompt_tokens += len(req.prompt_ids)
        if req.max_samples > req.scheduled_samples:
            batch.sample_indices.append(index)
            req.scheduled_samples += 1
            self.stages.running.append(req)
        else:
            batch.finishing.append(req)


def _input_logprobs(batch: ScheduledBatch, req: Request, offset: int, start: int, end: int) -> None:
    """The prompt logprobs that ``req``'s chunk ``[start, end)`` (its tokens from
    ``offset`` in the batch's [T] layout) computes: the logits at position ``p`` score
    prompt token ``p + 1``, so those of prompt positions ``start + 1 ... end`` that no
    earlier chunk computed."""
    first = max(req.input_logprob_next, start + 1)
    last = min(end, len(req.prompt_ids) - 1)
    if first > last:
        return
    # The radix cache serves no prefix past the position before the next one to compute.
    assert first == req.input_logprob_next, (req.rid, first, req.input_logprob_next)
    batch.add_input_logprobs(req, offset + first - 1 - start, req.prompt_ids[first : last + 1])
    req.input_logprob_next = last + 1
