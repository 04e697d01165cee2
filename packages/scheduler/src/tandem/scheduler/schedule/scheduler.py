"""The scheduler: one loop for both modes, a short policy over small managers.

normal loop: schedule a batch, launch it, wait for its copy-done, process it.
overlap loop (the default): schedule and launch batch N+1 from host state alone,
*then* wait for batch N, so the device always has the next batch queued.
Policy: prefill first (``PrefillManager``), decode rows riding along when mixed
chunks are on, else a decode batch (``DecodeManager``, or ``SpecPolicy`` with
speculative decoding); results go through ``Release``. Rows and pages live in
``Resources``. docs/concepts/architecture.md walks through one request.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.kv.resources import Resources
from tandem.scheduler.messages import (
    GrammarMasks,
    LaunchedBatch,
    Runner,
    SamplingInputs,
    ScheduledBatch,
    StepResult,
    Update,
)
from tandem.scheduler.request import FinishReason, Request, Stages
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.decode import DecodeManager
from tandem.scheduler.schedule.prefill import PrefillManager
from tandem.scheduler.schedule.release import Release
from tandem.scheduler.schedule.side import Side
from tandem.scheduler.schedule.spec_gate import SpecGate
from tandem.scheduler.schedule.spec_policy import SpecPolicy


class Scheduler:
    """Continuous batching on the normal or the overlap loop."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        *,
        eos_ids: Collection[int],
        context_length: int,
        strict_accounting: bool = False,
        spec_batch_limit: int | None = None,
        spec_gate: bool = False,
    ) -> None:
        """``spec_batch_limit``: with speculative decoding, decode plainly from this many
        decoding requests on (``SpecPolicy``); ``None``: never. ``spec_gate``: also
        where the measured step times say drafting loses (``SpecGate``)."""
        self.config = config
        self.runner = runner
        self.overlap = not config.disable_overlap_schedule
        self.context_length = context_length
        self.strict_accounting = strict_accounting
        self.counters = counters = Counters()
        self.stages = stages = Stages()
        self.waiting, self.prefilling = stages.waiting, stages.prefilling
        self.running, self.retiring = stages.running, stages.retiring
        self.kv_pool, self.req_pool = runner.kv_pool, runner.req_pool
        self.resources = res = Resources(
            runner.req_pool,
            runner.kv_pool,
            radix=not config.disable_radix_cache,
            evict_ahead=config.max_running_requests,
            discard_rows=runner.discard_rows,
            strict=strict_accounting,
        )
        self.radix = res.radix
        spec = None
        if config.speculative:
            accept, lookahead = config.speculative_max_accept, config.speculative_lookahead
            gate = SpecGate() if spec_gate else None
            spec = SpecPolicy(accept, lookahead, res, counters, spec_batch_limit, gate)
        self.spec = spec
        self.release = Release(stages, res, counters, eos_ids, spec)
        self.prefill = PrefillManager(config, stages, res, counters, spec)
        self.decode = DecodeManager(stages, res, self.release, counters, spec)
        self._previous: LaunchedBatch | None = None  # the overlap loop's batch in flight
        self._pending: list[Update] = []  # aborts reported by the next iterate
        self._new_period = True  # idle before the next launch (for the timeline)
        self._constrained: set[Request] = set()  # requests with a grammar, until finished
        self.disagg: Side | None = None  # set by ``disaggregate``
        # Diagnostic hook (tests, tools): keep each sampled row's logits by request id.
        self.record_logits = False
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}

    def disaggregate(self, side: Side) -> None:
        """Serve one half of disaggregated requests (``disagg``)."""
        self.disagg = side

    # -- intake -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.max_samples = min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids))
        if req.grammar is not None:
            self._constrained.add(req)
        disagg = self.disagg
        if disagg is not None and req.bootstrap is not None:
            refused = disagg.add(req)
            if refused is not None:
                self._pending.append(refused)
                return
            if disagg.holds_arrivals:
                return  # it waits there for its KV, not for a prefill
        self.stages.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """End request ``rid`` wherever it is; its resources come back once no
        launched batch uses them. Returns whether the request was found."""
        stages = self.stages
        if self.disagg is not None:
            update = self.disagg.abort(rid)
            if update is not None:
                self._pending.append(update)
                return True
        for req in (*stages.waiting, *stages.prefilling, *stages.running, *stages.retiring):
            if req.rid == rid and not req.finished:
                if req in stages.waiting:
                    stages.waiting.remove(req)
                req.retracting = False  # an aborted request is not requeued
                reason = FinishReason.abort("aborted by the client")
                self._pending.append(self.release.finish(req, reason))
                self.release.release(req)
                if self.disagg is not None and req.bootstrap is not None:
                    self.disagg.ended(req)
                return True
        return False

    def has_work(self) -> bool:
        s = self.stages
        return bool(
            s.waiting or s.prefilling or s.running or s.retiring or self._pending or self._previous
        ) or (self.disagg is not None and self.disagg.has_work())

    def waits_on_peers(self) -> bool:
        """Whether all that is left is a disaggregation peer's answer: no batch to build,
        none in flight (the loop may sleep until an event or a timeout)."""
        s = self.stages
        return self.disagg is not None and not (
            s.waiting or s.prefilling or s.running or self._pending or self._previous
        )

    def has_requests(self) -> bool:
        """Whether a request is queued or running (``has_work`` without what only remains
        of finished requests: a batch in flight, retiring rows, aborts to report)."""
        s = self.stages
        return bool(s.waiting or s.prefilling or s.running)

    def flush_cache(self) -> bool:
        """Empty the radix cache, SGLang's ``flush_cache``: only with no work at all
        (returns ``False`` otherwise, and nothing changes)."""
        if self.has_work():
            return False
        if self.radix is not None:
            self.radix.reset()
        return True

    # -- one iteration ----------------------------------------------------------------------
    def iterate(self) -> list[Update]:
        """One iteration of the configured loop; returns what requests produced.

        A batch with constrained rows needs their masks, which depend on every token
        before it: the normal loop writes them before launch; the overlap loop on the
        CPU after processing the batch before, while this one's forward runs (its
        sampling waits for them); on accelerators, whose sampling is enqueued at launch,
        the overlap loop processes the batch before first, for that step only."""
        start = time.perf_counter()
        updates, self._pending = self._pending, []
        if self.disagg is not None:
            updates += self.disagg.poll()
        decode_steps = self.counters.decode_steps
        waited = 0.0
        batch = self.schedule()
        if batch is not None and batch.grammar is not None:
            if self.overlap and not self.runner.masks_wait_on_stream:
                waited += self._land(self._previous, updates)
                self._previous = None
            if not self.overlap or not self.runner.masks_wait_on_stream:
                self._fill_masks(batch)
        launched = self._launch(batch) if batch is not None else None
        if self.overlap:
            previous, self._previous = self._previous, launched
        else:
            previous = launched
        waited += self._land(previous, updates)
        if launched is not None and _unwritten(launched.batch.grammar):
            self._fill_masks(launched.batch)
        host_s = time.perf_counter() - start - waited
        self.counters.scheduler_s += host_s
        if self.counters.decode_steps != decode_steps:
            self.counters.decode_scheduler_s += host_s
        if not self.has_work():
            self._new_period = True
            if self.strict_accounting:
                self.check_accounting()
        return updates

    def _land(self, launched: LaunchedBatch | None, updates: list[Update]) -> float:
        """Wait for ``launched`` (if any) and process it into ``updates``; returns the
        seconds waited."""
        if launched is None:
            return 0.0
        t = time.perf_counter()
        result = launched.wait()  # the only host wait: this batch's copy-done
        waited = time.perf_counter() - t
        self.runner.timeline.collect()
        if self.spec is not None:
            self.spec.steps_timed(self.runner.timeline.take_steps())
        updates += self.process(launched.batch, result)
        return waited

    def _fill_masks(self, batch: ScheduledBatch) -> None:
        """Write the constrained rows' masks from their matchers, and say so. A row
        whose request ended meanwhile (overshoot) may sample anything: it is
        discarded."""
        masks = batch.grammar
        assert masks is not None
        reqs = batch.sampling_reqs
        if batch.mode is ForwardMode.SPEC_DECODE:
            masks.matchers = [None if reqs[k].finished else reqs[k].grammar for k in masks.rows]
            masks.rows = [batch.sample_indices[k] for k in masks.rows]  # the worker's rows
            masks.ready.set()  # the worker walks its tree with them, then undoes it
            return
        for j, k in enumerate(masks.rows):
            req = reqs[k]
            if req.finished:
                masks.bitmask[j].fill_(-1)
            else:
                req.grammar.fill(masks.bitmask, j)
        masks.ready.set()
        if batch.step:  # launched already: the other ranks wait too
            self.runner.share_masks(batch.step, masks.bitmask)

    def _masks(self, batch: ScheduledBatch) -> GrammarMasks | None:
        """Unwritten masks for ``batch``'s constrained sampling rows, or None. Without a
        constrained request in the engine (``_constrained``) the batch is not scanned."""
        if not self._constrained:
            return None
        self._constrained = {req for req in self._constrained if not req.finished}
        rows = [k for k, req in enumerate(batch.sampling_reqs) if req.grammar is not None]
        if not rows:
            return None
        words = (self.runner.vocab_size + 31) // 32
        return GrammarMasks(rows, torch.zeros((len(rows), words), dtype=torch.int32))

    def abandon_masks(self) -> None:
        """The loop is ending mid-step: a batch in flight must not wait for masks."""
        previous = self._previous
        if previous is not None and previous.batch.grammar is not None:
            previous.batch.grammar.allow_all()

    def schedule(self) -> ScheduledBatch | None:
        """The next batch from host state alone: prefill first (decode rows riding
        along with mixed chunks), else decode."""
        counters, stages = self.counters, self.stages
        batch = None
        if stages.waiting or stages.prefilling:
            batch = self.prefill.schedule(decoding=len(self.decode.decodable()))
        if batch is None:
            batch = self.decode.schedule()
            counters.decode_steps += batch is not None
        elif self.config.enable_mixed_chunk and self.decode.add_rows(batch):
            batch.mode = ForwardMode.MIXED
            counters.mixed_steps += 1
        else:
            counters.prefill_steps += 1
        if batch is not None:
            batch.return_logits = self.record_logits
            batch.grammar = self._masks(batch)
            if self.disagg is not None:
                self.disagg.attach(batch)
        return batch

    def _launch(self, batch: ScheduledBatch) -> LaunchedBatch:
        for req in batch.reqs:
            req.in_flight += 1
        self.counters.forward_steps += 1
        batch.step = self.counters.forward_steps
        spec = self.spec if batch.mode is ForwardMode.SPEC_DECODE else None
        self.resources.launch(batch, spec.lookahead if spec is not None else None)
        launched = self.runner.launch(batch, SamplingInputs.of(batch), new_period=self._new_period)
        self._new_period = False
        return launched

    # -- results ----------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, result: StepResult) -> list[Update]:
        """Hand each sampling row's tokens to its request (after the prompt logprobs the
        batch computed, which its first token's update carries), discarding the
        overshoot of requests that ended after this batch was launched; then release."""
        self.release.stamp()
        if batch.input_logprob_reqs:
            self.release.input_logprobs(batch, result)
        updates: list[Update] = []
        tokens = result.next_token_ids.tolist()
        accepted = result.accept_lens.tolist() if result.accept_lens is not None else None
        for k, req in enumerate(batch.sampling_reqs):
            if req.finished:
                self.counters.overshoot_steps += 1  # launched before its end was known
                continue
            if accepted is not None:
                assert self.spec is not None
                new = self.spec.commit(req, tokens[k], int(accepted[k]))
            else:
                new = [tokens[k]]
                if self.spec is not None and batch.mode is ForwardMode.DECODE:
                    self.spec.committed_plainly(req)
                if result.logits is not None:
                    self.recorded_logits.setdefault(req.rid, []).append(result.logits[k])
            updates.append(self.release.receive(req, new, result, k))
        for req in batch.finishing:
            if not req.finished:
                reason = FinishReason("length", length=len(req.output_ids))
                updates.append(self.release.finish(req, reason))
        if self.disagg is not None:
            updates = self.disagg.prefilled(updates)  # held until their KV is sent
        self.release.settle(batch)
        return updates

    def check_accounting(self) -> None:
        """Strict accounting at idle (see ``Resources.check_idle``)."""
        self.resources.check_idle()


def _unwritten(masks: GrammarMasks | None) -> bool:
    return masks is not None and not masks.ready.is_set()
