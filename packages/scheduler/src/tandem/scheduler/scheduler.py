"""The scheduler: admission, batch selection, result processing, resource release.

This is the normal loop (DESIGN §4): pick a batch from host state, launch it, wait for
its copy-done, process its results. Batches are built from host-side truth only, so
the overlap loop can reuse ``schedule`` and ``process`` unchanged and merely reorder
launch and wait.

Admission is conservative for now: a request is admitted only when the KV pages for
its whole prompt plus ``max_new_tokens`` are available after what running requests
may still need, so decoding never runs out of KV and nothing is ever retracted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.memory import PagedKVPool, ReqToTokenPool
from tandem.scheduler.model_runner import ModelRunner, StepResult
from tandem.scheduler.request import FinishReason, Request
from tandem.scheduler.sampling import SamplingBatchInfo
from tandem.scheduler.schedule_batch import ScheduledBatch
from tandem.scheduler.stop import token_stop

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Figures reported by ``get_server_info``."""

    forward_steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


@dataclass
class Update:
    """What one step produced for one request: new ids and whether it finished."""

    req: Request
    new_ids: list[int] = field(default_factory=list)
    finished: bool = False


class Scheduler:
    """Continuous batching on the normal loop (FCFS)."""

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
        self.req_pool: ReqToTokenPool = runner.req_pool
        self.kv_pool: PagedKVPool = runner.kv_pool
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        self.strict_accounting = strict_accounting
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully prefilled
        self.running: list[Request] = []  # decoding
        self.counters = Counters()
        # Diagnostic hook (tests, tools): keep each sampled row's logits by request id.
        self.record_logits = False
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}
        self._chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else 1 << 62

    # -- intake -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # -- one normal-loop step -----------------------------------------------------------------
    def step(self) -> list[Update]:
        """Schedule, launch, wait, process: one iteration of the normal loop."""
        batch = self.schedule()
        if batch is None:
            return []
        sampling = self._sampling_info(batch)
        launched = self.runner.launch(batch, sampling)
        return self.process(batch, launched.wait())

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next batch from host state alone: prefill first (continuing chunked
        prompts, then admitting waiting requests FCFS), else decode."""
        batch = self._schedule_prefill()
        if batch is not None:
            self.counters.prefill_steps += 1
        elif self.running:
            self.counters.decode_steps += 1
            batch = self._schedule_decode()
        if batch is not None:
            batch.return_logits = self.record_logits
        return batch

    def _outstanding_pages(self) -> int:
        """KV pages admitted requests may still need before they finish."""
        total = 0
        for req in (*self.prefilling, *self.running):
            need = self.kv_pool.pages_for(self._max_kv_len(req))
            total += max(0, need - len(req.pages))
        return total

    def _max_kv_len(self, req: Request) -> int:
        # The last sampled token never gets its K/V written.
        return len(req.prompt_ids) + max(req.params.max_new_tokens - 1, 0)

    def _admit(self, req: Request) -> bool:
        need = self.kv_pool.pages_for(self._max_kv_len(req))
        if need > self.kv_pool.available_pages - self._outstanding_pages():
            return False
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.row = row
        self.prefilling.append(req)
        return True

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_prefill_tokens
        chosen: list[tuple[Request, int]] = []
        admitted: list[Request] = []
        for req in list(self.prefilling):
            if budget <= 0:
                break
            n = min(len(req.prompt_ids) - req.kv_len, self._chunk, budget)
            chosen.append((req, n))
            budget -= n
        room = self.config.max_running_requests - len(self.running) - len(self.prefilling)
        while self.waiting and budget > 0 and room > 0:
            req = self.waiting[0]
            remaining = len(req.prompt_ids)
            if remaining > min(budget, self._chunk) and chosen:
                break  # a new prompt that must be chunked starts a batch of its own
            if not self._admit(req):
                break
            self.waiting.popleft()
            admitted.append(req)
            n = min(remaining, self._chunk, budget)
            chosen.append((req, n))
            budget -= n
            room -= 1
        if not chosen:
            return None
        return self._build_prefill(chosen, admitted)

    def _take_slots(self, req: Request, start: int, end: int) -> list[int]:
        need = self.kv_pool.pages_for(end) - len(req.pages)
        if need > 0:
            pages = self.kv_pool.alloc_pages(need)
            if pages is None:  # admission reserved these pages: reaching this is a bug
                raise RuntimeError(f"KV pool exhausted for request {req.rid}")
            req.pages.extend(pages)
        return self.kv_pool.slots(req.pages, start, end)

    def _build_prefill(
        self, chosen: list[tuple[Request, int]], admitted: list[Request]
    ) -> ScheduledBatch:
        batch = ScheduledBatch(ForwardMode.PREFILL, [], [], [], penalty_resets=admitted)
        for i, (req, n) in enumerate(chosen):
            start, end = req.kv_len, req.kv_len + n
            slots = self._take_slots(req, start, end)
            batch.reqs.append(req)
            batch.prefix_lens.append(start)
            batch.extend_lens.append(n)
            batch.prefill_tokens.extend(req.prompt_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.out_cache_loc.extend(slots)
            self._table(batch, req, start, slots)
            req.kv_len = end
            if req.prefill_done and req.params.max_new_tokens > 0:
                batch.sample_indices.append(i)
        return batch

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch(ForwardMode.DECODE, [], [], [])
        for i, req in enumerate(self.running):
            pos = req.kv_len
            slots = self._take_slots(req, pos, pos + 1)
            batch.reqs.append(req)
            batch.prefix_lens.append(pos)
            batch.extend_lens.append(1)
            batch.decode_rows.append(req.row)  # type: ignore[arg-type]
            batch.positions.append(pos)
            batch.out_cache_loc.extend(slots)
            self._table(batch, req, pos, slots)
            batch.sample_indices.append(i)
            req.kv_len = pos + 1
        return batch

    @staticmethod
    def _table(batch: ScheduledBatch, req: Request, start: int, slots: list[int]) -> None:
        batch.table_rows.extend([req.row] * len(slots))  # type: ignore[list-item]
        batch.table_cols.extend(range(start, start + len(slots)))
        batch.table_slots.extend(slots)

    def _sampling_info(self, batch: ScheduledBatch) -> SamplingBatchInfo | None:
        reqs = batch.sampling_reqs
        if not reqs:
            return None
        return SamplingBatchInfo.build(
            [r.params for r in reqs],
            rows=[r.row for r in reqs],  # type: ignore[misc]
            steps=[r.sample_step for r in reqs],
            return_logprob=[r.return_logprob for r in reqs],
            top_logprobs_num=[r.top_logprobs_num for r in reqs],
            device=self.runner.device,
        )

    # -- results --------------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, result: StepResult) -> list[Update]:
        """Append the batch's tokens, detect finishes, free finished requests."""
        self.counters.forward_steps += 1
        updates: list[Update] = []
        tokens = result.next_token_ids.tolist()
        for k, i in enumerate(batch.sample_indices):
            req = batch.reqs[i]
            if result.logits is not None:
                self.recorded_logits.setdefault(req.rid, []).append(result.logits[k])
            updates.append(self._append(req, int(tokens[k]), result, k))
        for req in batch.reqs:
            if req.prefill_done and req in self.prefilling:
                self.prefilling.remove(req)
                self.counters.prompt_tokens += len(req.prompt_ids)
                if req.params.max_new_tokens == 0:
                    req.finish = FinishReason("length", length=0)
                    updates.append(Update(req, [], True))
                else:
                    self.running.append(req)
        for update in updates:
            if update.finished:
                self._release(update.req)
        return updates

    def _append(self, req: Request, token: int, result: StepResult, k: int) -> Update:
        req.output_ids.append(token)
        self.counters.generated_tokens += 1
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append(float(result.logprobs[k]))
            if req.top_logprobs_num and result.top_logprob_values is not None:
                values = result.top_logprob_values[k, : req.top_logprobs_num].tolist()
                ids = result.top_logprob_ids[k, : req.top_logprobs_num].tolist()  # type: ignore[index]
                req.output_top_logprobs.append(list(zip(values, ids, strict=True)))
        req.finish = self._finish_after(req, token)
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
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.context_length:
            req.stop.finish_text()
            return FinishReason("length", length=len(req.output_ids))
        return None

    def _release(self, req: Request) -> None:
        """Return a finished request's row and pages. In the normal loop its last
        forward has completed, so nothing queued still reads them."""
        if req in self.running:
            self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        self.counters.finished_requests += 1
        if req.pages:
            self.kv_pool.free_pages(req.pages)
            req.pages = []
        if req.row is not None:
            self.runner.discard_rows([req.row])
            self.req_pool.free(req.row)
            req.row = None
        if self.strict_accounting and not self.has_work():
            self.check_accounting()

    def check_accounting(self) -> None:
        """Strict accounting (DESIGN §6): when idle, every row and KV page is free."""
        rows_free = self.req_pool.available == self.req_pool.num_rows
        pages_free = self.kv_pool.available_pages == self.kv_pool.num_pages - 1
        if not (rows_free and pages_free):
            raise RuntimeError(
                "memory leak at idle: "
                f"{self.req_pool.num_rows - self.req_pool.available} rows and "
                f"{self.kv_pool.num_pages - 1 - self.kv_pool.available_pages} KV pages held"
            )
