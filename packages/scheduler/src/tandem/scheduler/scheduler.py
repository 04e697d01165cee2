"""The scheduler: admission, batch selection, result processing, resource release.

Two loops share every piece (docs/concepts/overlap-loop.md):

* normal (``overlap=False``): schedule a batch, launch it, wait for its copy-done,
  process its results;
* overlap (the default): schedule batch N+1 from host state alone and launch it
  *before* waiting for batch N, so the device always has the next batch queued.

Host-side truth runs one step ahead of what has been processed: ``kv_len`` and
``scheduled_samples`` count what was launched, ``output_ids`` what came back. Decode
inputs never come from the host: they are resolved from the FutureMap on the forward
stream. Three consequences are handled here, each in one place:

* overshoot: a request that stops on a token is known to have finished one step
  late; the decode launched for it meanwhile is discarded (``process``). A request
  whose end is predictable (``max_new_tokens``) is never scheduled past it.
* release: a row and KV pages go back only when no launched, unprocessed batch still
  uses them (``Request.in_flight == 0``; ``_maybe_release``). Rows and pages handed to
  a new request are then written only by later batches, after in stream order.
* retraction: when decode runs out of KV pages, the newest requests go back to the
  queue and later prefill their prompt plus the tokens they already produced.

With speculative decoding (a ``SpeculativeWorker`` in the runner) decode batches are
speculative steps. A step commits 1 to ``max_accept`` tokens and the host learns how
many one step late, so ``Request.kv_len`` becomes an upper bound: launching adds
``max_accept``, processing takes back what was not committed. Each step reserves (and
maps) KV for ``lookahead`` positions past that bound, two steps ahead of the truth the
device reads from the FutureMap (``_add_spec_rows``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import torch

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.memory import PagedKVPool, ReqToTokenPool
from tandem.scheduler.messages import (
    LaunchedBatch,
    PenaltyReset,
    SamplingSpec,
    ScheduledBatch,
    StepResult,
    Update,
)
from tandem.scheduler.model_runner import ModelRunner
from tandem.scheduler.page_ledger import PageLedger
from tandem.scheduler.radix_cache import RadixCache
from tandem.scheduler.request import FinishReason, Request
from tandem.scheduler.stop import token_stop

log = logging.getLogger(__name__)


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
    spec_verify_steps: int = 0
    spec_committed_tokens: int = 0

    @property
    def avg_spec_accept_length(self) -> float:
        """Mean tokens committed per speculative verify step (accepted drafts plus
        the bonus token), SGLang's figure; 0 before any step."""
        if not self.spec_verify_steps:
            return 0.0
        return self.spec_committed_tokens / self.spec_verify_steps


class Scheduler:
    """Continuous batching on the normal or the overlap loop."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        *,
        eos_ids: Collection[int],
        context_length: int,
        strict_accounting: bool = False,
    ) -> None:
        self.config = config
        self.runner = runner
        self.overlap = not config.disable_overlap_schedule
        self.spec = config.speculative
        self.spec_accept = config.speculative_max_accept if self.spec else 1
        self.lookahead = config.speculative_lookahead if self.spec else 1
        self.req_pool: ReqToTokenPool = runner.req_pool
        self.kv_pool: PagedKVPool = runner.kv_pool
        # Strict accounting also checks every page hand-over as it happens.
        self.ledger = PageLedger(self.kv_pool.num_pages) if strict_accounting else None
        self.radix = (
            None
            if config.disable_radix_cache
            else RadixCache(self.kv_pool.page_size, self._cache_frees)
        )
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        self.strict_accounting = strict_accounting
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully scheduled
        self.running: list[Request] = []  # decoding
        self.retiring: list[Request] = []  # finished or retracting, still in flight
        self.counters = Counters()
        self._chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else 1 << 62
        self._previous: LaunchedBatch | None = None
        self._pending: list[Update] = []
        self._new_period = True
        self._admissions = 0
        self._processed_at = 0.0  # when ``process`` last began (tokens' host time)
        # Diagnostic hook (tests, tools): keep each sampled row's logits by request id.
        self.record_logits = False
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}

    # -- intake -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.prefilling
            or self.running
            or self.retiring
            or self._pending
            or self._previous is not None
        )

    def abort(self, rid: str) -> bool:
        """End request ``rid`` wherever it is; its resources come back once no
        launched batch uses them. Returns whether the request was found."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._abort(req)
                self.counters.finished_requests += 1  # nothing to release
                return True
        for req in (*self.prefilling, *self.running, *self.retiring):
            if req.rid == rid and not req.finished:
                req.retracting = False  # an aborted request is not requeued
                self._abort(req)
                self._leave(req)
                self._maybe_release(req)
                return True
        return False

    def _abort(self, req: Request) -> None:
        req.finish = FinishReason("abort", message="aborted by the client")
        req.stop.finish_text()
        self.counters.aborted_requests += 1
        self._pending.append(Update(req, [], True))

    # -- one loop iteration ---------------------------------------------------------------------
    def iterate(self) -> list[Update]:
        """One iteration of the configured loop; returns what requests produced."""
        start = time.perf_counter()
        updates, self._pending = self._pending, []
        batch = self.schedule()
        launched = self._launch(batch) if batch is not None else None
        if self.overlap:
            previous, self._previous = self._previous, launched
        else:
            previous = launched
        waited = 0.0
        if previous is not None:
            t = time.perf_counter()
            result = previous.wait()  # the only host wait: this batch's copy-done
            waited = time.perf_counter() - t
            self.runner.timeline.collect()
            updates += self.process(previous.batch, result)
        self.counters.scheduler_s += time.perf_counter() - start - waited
        if not self.has_work():
            self._new_period = True
            if self.strict_accounting:
                self.check_accounting()
        return updates

    def _launch(self, batch: ScheduledBatch) -> LaunchedBatch:
        sampling = self._sampling_spec(batch)
        for req in batch.reqs:
            req.in_flight += 1
        self.counters.forward_steps += 1
        batch.step = self.counters.forward_steps
        if self.ledger is not None:
            self.ledger.launch(batch.step, self._writes(batch))
        launched = self.runner.launch(batch, sampling, new_period=self._new_period)
        self._new_period = False
        return launched

    def _writes(self, batch: ScheduledBatch) -> list[tuple[Request, set[int]]]:
        """The KV pages ``batch`` writes, per request (for the page ledger): its new
        tokens' slots, or a speculative step's lookahead slots."""
        size = self.kv_pool.page_size
        if batch.mode is ForwardMode.SPEC_DECODE:
            slots, counts = batch.table_slots, [self.lookahead] * len(batch.reqs)
        else:
            slots, counts = batch.out_cache_loc, batch.extend_lens
        writes, start = [], 0
        for req, n in zip(batch.reqs, counts, strict=True):
            writes.append((req, {slot // size for slot in slots[start : start + n]}))
            start += n
        return writes

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next batch from host state alone: prefill first (continuing chunked
        prompts, then admitting waiting requests), else decode."""
        batch = self._schedule_prefill()
        if batch is not None:
            if self.config.enable_mixed_chunk and self._add_decode_rows(batch):
                batch.mode = ForwardMode.MIXED
                self.counters.mixed_steps += 1
            else:
                self.counters.prefill_steps += 1
        else:
            batch = self._schedule_decode()
            if batch is not None:
                self.counters.decode_steps += 1
        if batch is not None:
            batch.return_logits = self.record_logits
        return batch

    def _max_samples(self, req: Request) -> int:
        return min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids))

    def _decodable(self) -> list[Request]:
        # Never schedule past a predictable end: no overshoot for length limits.
        return [r for r in self.running if r.scheduled_samples < self._max_samples(r)]

    def _available_pages(self) -> int:
        evictable = self.radix.evictable_pages if self.radix is not None else 0
        return self.kv_pool.available_pages + evictable

    def _alloc_pages(self, count: int) -> list[int] | None:
        if count <= 0:
            return []
        short = count - self.kv_pool.available_pages
        if short > 0 and self.radix is not None:
            # Evict ahead, a page for every row: a decode step allocates for each
            # request in turn, and each eviction walks the whole tree, so evicting only
            # the shortfall would walk it once per request once the pool is full.
            self.radix.evict(max(short, self.config.max_running_requests))
        return self.kv_pool.alloc_pages(count)

    def _order_waiting(self) -> None:
        if self.config.schedule_policy != "lpm" or self.radix is None or len(self.waiting) < 2:
            return
        radix = self.radix
        scored = sorted(
            enumerate(self.waiting),
            key=lambda item: (
                -radix.prefix_length(item[1].fill_ids, len(item[1].fill_ids) - 1),
                item[0],
            ),
        )
        self.waiting = deque(req for _, req in scored)

    def _admit(self, req: Request, reserve: int) -> bool:
        """Give ``req`` a row and its cached prefix, if its first chunk fits after
        ``reserve`` pages kept for decoding requests."""
        fill = req.fill_ids
        match = None
        if self.radix is not None:
            match = self.radix.match_prefix(fill, max_tokens=len(fill) - 1)
            self.radix.lock(match.node)
        cached = match.num_tokens if match is not None else 0
        first = min(len(fill) - cached, self._chunk)
        need = self.kv_pool.pages_for(cached + first) - (len(match.pages) if match else 0)
        row = None
        if need + reserve <= self._available_pages():
            row = self.req_pool.alloc()
        if row is None:
            if match is not None:
                self.radix.unlock(match.node)  # type: ignore[union-attr]
            return False
        req.row = row
        if match is not None:
            req.prefix_node = match.node
            req.pages = list(match.pages)
            req.shared_pages = len(match.pages)
            if self.ledger is not None:
                self.ledger.hold(req, match.pages)
        req.kv_len = cached
        if req.retractions == 0:
            req.cached_tokens = cached
            self.counters.cached_tokens += cached
        self._admissions += 1
        req.admit_seq = self._admissions
        self.prefilling.append(req)
        return True

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_prefill_tokens
        chosen: list[tuple[Request, int]] = []
        admitted: list[Request] = []
        for req in list(self.prefilling):
            if budget <= 0:
                break
            n = min(len(req.fill_ids) - req.kv_len, self._chunk, budget)
            if not self._reserve(req, req.kv_len + n):
                break
            chosen.append((req, n))
            budget -= n
        self._order_waiting()
        room = self.config.max_running_requests - self._admitted_count()
        reserve = len(self._decodable())  # one page per decoding request, optimistically
        while self.waiting and budget > 0 and room > 0:
            req = self.waiting[0]
            if len(req.fill_ids) > min(budget, self._chunk) and chosen:
                break  # a prompt that must be chunked starts a batch of its own
            if not self._admit(req, reserve):
                break
            self.waiting.popleft()
            admitted.append(req)
            n = min(len(req.fill_ids) - req.kv_len, self._chunk, budget)
            if not self._reserve(req, req.kv_len + n):
                raise RuntimeError(f"admitted request {req.rid} has no KV for its first chunk")
            chosen.append((req, n))
            budget -= n
            room -= 1
        if not chosen:
            return None
        return self._build_prefill(chosen, admitted)

    def _admitted_count(self) -> int:
        return len(self.running) + len(self.prefilling) + len(self.retiring)

    def _reserve(self, req: Request, end: int) -> bool:
        """Make ``req`` hold pages for token positions below ``end``."""
        need = self.kv_pool.pages_for(end) - len(req.pages)
        if need <= 0:
            return True
        pages = self._alloc_pages(need)
        if pages is None:
            return False
        if self.ledger is not None:
            self.ledger.take(req, pages)
        req.pages.extend(pages)
        return True

    def _build_prefill(
        self, chosen: list[tuple[Request, int]], admitted: list[Request]
    ) -> ScheduledBatch:
        batch = ScheduledBatch(ForwardMode.PREFILL)
        for req in admitted:
            assert req.row is not None
            outputs = list(req.output_ids)
            batch.penalty_resets.append(PenaltyReset(req.row, req.prompt_ids, outputs, req.params))
            if req.kv_len > 0:  # the cached prefix: the new row must point at its slots
                batch.table_rows.extend([req.row] * req.kv_len)
                batch.table_cols.extend(range(req.kv_len))
                batch.table_slots.extend(self.kv_pool.slots(req.pages, 0, req.kv_len))
        for req, n in chosen:
            start, end = req.kv_len, req.kv_len + n
            slots = self.kv_pool.slots(req.pages, start, end)
            index = self._append_entry(batch, req, start, n, slots)
            batch.prefill_tokens.extend(req.fill_ids[start:end])
            batch.positions.extend(range(start, end))
            if self.spec:
                # The draft reads the chunk shifted by one; a sampling request's sampled
                # token replaces this on the device.
                batch.next_tokens.append(req.fill_ids[min(end, len(req.fill_ids) - 1)])
                req.spec_committed = end
            req.kv_len = end
            if not req.prefill_done:
                continue
            self.prefilling.remove(req)
            if req.retractions == 0:
                self.counters.prompt_tokens += len(req.prompt_ids)
            if self._max_samples(req) > req.scheduled_samples:
                batch.sample_indices.append(index)
                req.scheduled_samples += 1
                self.running.append(req)  # decodable from the next batch on
            else:
                batch.finishing.append(req)
        return batch

    def _append_entry(
        self, batch: ScheduledBatch, req: Request, start: int, n: int, slots: list[int]
    ) -> int:
        assert req.row is not None
        batch.reqs.append(req)
        batch.rows.append(req.row)
        batch.prefix_lens.append(start)
        batch.extend_lens.append(n)
        batch.out_cache_loc.extend(slots)
        batch.table_rows.extend([req.row] * n)
        batch.table_cols.extend(range(start, start + n))
        batch.table_slots.extend(slots)
        return len(batch.reqs) - 1

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self._make_room_for_decode():
            return None
        if self.spec:
            batch = ScheduledBatch(ForwardMode.SPEC_DECODE)
            return batch if self._add_spec_rows(batch) else None
        batch = ScheduledBatch(ForwardMode.DECODE)
        return batch if self._add_decode_rows(batch) else None

    def _add_spec_rows(self, batch: ScheduledBatch) -> bool:
        """Append every decodable request as one speculative row.

        The step starts from the true committed length ``L <= bound`` (the device
        reads it from the FutureMap) and writes KV at ``[L, L + lookahead)``, so pages
        are reserved, and mapped in ``req_to_token`` in stream order, for every
        position below ``bound + lookahead``: whatever the step in flight commits, this
        one writes only into pages its request holds. Rejected positions are simply
        overwritten by a later step.
        """
        added = False
        for req in self._decodable():
            bound = req.kv_len
            end = bound + self.lookahead
            if not self._reserve(req, end):
                continue
            assert req.row is not None
            batch.reqs.append(req)
            batch.rows.append(req.row)
            batch.prefix_lens.append(bound)
            batch.extend_lens.append(self.spec_accept)
            batch.table_rows.extend([req.row] * (end - bound))
            batch.table_cols.extend(range(bound, end))
            batch.table_slots.extend(self.kv_pool.slots(req.pages, bound, end))
            batch.sample_indices.append(len(batch.reqs) - 1)
            batch.spec_bounds.append(bound)
            batch.spec_steps.append(req.spec_launched)
            req.kv_len = bound + self.spec_accept
            req.scheduled_samples += 1  # a step yields at least one token
            req.spec_launched += 1
            added = True
        return added

    def _add_decode_rows(self, batch: ScheduledBatch) -> bool:
        """Append every decodable request as one decode row; False if none fits."""
        added = False
        for req in self._decodable():
            if req in batch.reqs or not self._reserve(req, req.kv_len + 1):
                continue
            pos = req.kv_len
            slots = self.kv_pool.slots(req.pages, pos, pos + 1)
            batch.sample_indices.append(self._append_entry(batch, req, pos, 1, slots))
            batch.num_decode += 1
            batch.positions.append(pos)
            req.kv_len = pos + 1
            req.scheduled_samples += 1
            added = True
        return added

    # -- retraction ---------------------------------------------------------------------------
    def _make_room_for_decode(self) -> bool:
        """Retract the newest requests until every decodable one gets its next page.
        False when pages only come back after a batch in flight is processed."""
        while True:
            decodable = self._decodable()
            need = sum(
                max(0, self.kv_pool.pages_for(r.kv_len + self.lookahead) - len(r.pages))
                for r in decodable
            )
            if need <= self._available_pages():
                return True
            victims = sorted((*self.running, *self.prefilling), key=lambda r: r.admit_seq)
            if len(victims) <= 1:
                if self.retiring:
                    return False  # finished requests' pages come back after processing
                raise RuntimeError("KV pool too small for a single request")
            victim = victims[-1]
            self._leave(victim)
            victim.retracting = True
            self.counters.retracted_requests += 1
            if not self._maybe_release(victim):
                return False

    def _requeue(self, req: Request) -> None:
        """A retracted request goes back to the front of the queue, to prefill its
        prompt and the tokens it produced (its next sample continues the same
        seeded stream, since ``scheduled_samples`` equals what was received)."""
        req.retracting = False
        req.retractions += 1
        req.fill_ids = req.prompt_ids + req.output_ids
        req.kv_len = 0
        req.spec_committed = 0
        req.scheduled_samples = len(req.output_ids)
        self.waiting.appendleft(req)

    def _sampling_spec(self, batch: ScheduledBatch) -> SamplingSpec | None:
        """Host data for the batch's sampling tensors; the model runner turns it into
        device tensors on the forward stream, like every other input of the batch."""
        reqs = batch.sampling_reqs
        if not reqs:
            return None
        steps = [r.scheduled_samples - 1 for r in reqs]
        if batch.mode is ForwardMode.SPEC_DECODE:
            steps = list(batch.spec_steps)
        return SamplingSpec(
            params=[r.params for r in reqs],
            rows=batch.sample_rows,
            steps=steps,
            return_logprob=[r.return_logprob for r in reqs],
            top_logprobs_num=[r.top_logprobs_num for r in reqs],
        )

    # -- results --------------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, result: StepResult) -> list[Update]:
        """Append the batch's tokens, detect finishes, release what is done."""
        self._processed_at = time.perf_counter()  # one time for the step's tokens
        if batch.mode is ForwardMode.SPEC_DECODE:
            return self._process_spec(batch, result)
        updates: list[Update] = []
        tokens = result.next_token_ids.tolist()
        for k, i in enumerate(batch.sample_indices):
            req = batch.reqs[i]
            if req.finished:
                self.counters.overshoot_steps += 1  # launched before its end was known
                continue
            if result.logits is not None:
                self.recorded_logits.setdefault(req.rid, []).append(result.logits[k])
            updates.append(self._append(req, int(tokens[k]), result, k))
        for req in batch.finishing:
            if not req.finished:
                req.finish = FinishReason("length", length=len(req.output_ids))
                req.stop.finish_text()
                self._leave(req)
                updates.append(Update(req, [], True))
        self._land(batch)
        return updates

    def _process_spec(self, batch: ScheduledBatch, result: StepResult) -> list[Update]:
        """A speculative step's results: per row, the committed tokens (accepted
        drafts, then the bonus), appended one by one until the request finishes."""
        updates: list[Update] = []
        assert result.accept_lens is not None
        tokens = result.next_token_ids.tolist()
        counts = result.accept_lens.tolist()
        for k, req in enumerate(batch.reqs):
            if req.finished:
                self.counters.overshoot_steps += 1
                continue
            n = int(counts[k])
            req.spec_verify_ct += 1
            req.spec_committed += n
            req.kv_len -= self.spec_accept - n  # the bound shrinks to what was committed
            req.scheduled_samples += n - 1
            self.counters.spec_verify_steps += 1
            self.counters.spec_committed_tokens += n
            update = Update(req)
            for token in tokens[k][:n]:
                update.new_ids.append(int(token))
                self._record_token(req, int(token))
                req.finish = self._finish_after(req, int(token))
                if req.finish is not None:
                    self._leave(req)
                    update.finished = True
                    break
            updates.append(update)
        self._land(batch)
        return updates

    def _land(self, batch: ScheduledBatch) -> None:
        """``batch`` is processed: its requests' resources may go back."""
        if self.ledger is not None:
            self.ledger.land(batch.step, batch.reqs)
        for req in batch.reqs:
            req.in_flight -= 1
            self._maybe_release(req)

    def _record_token(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        if req.token_times is not None:
            req.token_times.append(self._processed_at)
        self.counters.generated_tokens += 1

    def _append(self, req: Request, token: int, result: StepResult, k: int) -> Update:
        self._record_token(req, token)
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append(float(result.logprobs[k]))
            if req.top_logprobs_num and result.top_logprob_values is not None:
                values = result.top_logprob_values[k, : req.top_logprobs_num].tolist()
                ids = result.top_logprob_ids[k, : req.top_logprobs_num].tolist()  # type: ignore[index]
                req.output_top_logprobs.append(list(zip(values, ids, strict=True)))
        req.finish = self._finish_after(req, token)
        if req.finish is not None:
            self._leave(req)
        return Update(req, [token], req.finish is not None)

    def _finish_after(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        stop_ids = params.stop_token_ids or ()
        if token_stop(token, stop_ids, self.eos_ids, params.ignore_eos):
            req.stop.finish_text()
            return FinishReason("stop", matched=token)
        matched = req.stop.feed([token])
        if matched is not None:
            return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= self._max_samples(req):
            req.stop.finish_text()
            return FinishReason("length", length=len(req.output_ids))
        return None

    def _leave(self, req: Request) -> None:
        """Take a finished, aborted or retracted request out of scheduling; its
        resources wait in ``retiring`` until no launched batch uses them."""
        for pool in (self.running, self.prefilling):
            if req in pool:
                pool.remove(req)
        if req not in self.retiring:
            self.retiring.append(req)

    def _maybe_release(self, req: Request) -> bool:
        """Return a request's row and pages once nothing in flight reads them.
        True when released (or already free)."""
        if req not in self.retiring:
            return True
        if req.in_flight > 0:
            return False
        self.retiring.remove(req)
        self._free(req)
        if req.finished:
            self.counters.finished_requests += 1
        elif req.retracting:
            self._requeue(req)
        return True

    def _free(self, req: Request) -> None:
        if self.spec:
            # Positions past the processed truth hold rejected or overshoot KV.
            req.kv_len = req.spec_committed
        ledger = self.ledger
        whole = 0
        if self.radix is not None:
            # Everything below kv_len was computed: share it with later requests.
            seq = (req.prompt_ids + req.output_ids)[: req.kv_len]
            whole = len(seq) // self.kv_pool.page_size
            if ledger is not None:
                ledger.adopt(req, req.pages[:whole])
            self.radix.insert(seq, req.pages[:whole])
        if ledger is not None:
            ledger.free(req, req.pages[whole:])
        self.kv_pool.free_pages(req.pages[whole:])
        if req.prefix_node is not None:
            assert self.radix is not None
            if ledger is not None:
                ledger.unhold(req, req.pages[: req.shared_pages])
            self.radix.unlock(req.prefix_node)
        req.pages, req.shared_pages, req.prefix_node = [], 0, None
        if req.row is not None:
            self.runner.discard_rows([req.row])
            self.req_pool.free(req.row)
            req.row = None

    def _cache_frees(self, pages: list[int]) -> None:
        """The radix cache lets go of ``pages`` (evicted, duplicates, reset)."""
        if self.ledger is not None:
            self.ledger.cache_frees(pages)
        self.kv_pool.free_pages(pages)

    def check_accounting(self) -> None:
        """Strict accounting (docs/concepts/memory.md): when idle, every row is free and every KV
        page is either free or held, unlocked, by the radix cache."""
        held_rows = self.req_pool.num_rows - self.req_pool.available
        cached = self.radix.cached_pages if self.radix is not None else 0
        locked = cached - (self.radix.evictable_pages if self.radix is not None else 0)
        lost = self.kv_pool.num_pages - 1 - self.kv_pool.available_pages - cached
        if held_rows or lost or locked:
            raise RuntimeError(
                f"accounting at idle: {held_rows} rows held, {lost} KV pages neither free "
                f"nor cached, {locked} cached pages still locked"
            )
        if self.radix is not None:
            self.radix.check()
        if self.ledger is not None:
            cached = self.radix.held_pages() if self.radix is not None else frozenset()
            self.ledger.check_idle(self.kv_pool.free_page_list(), cached)
