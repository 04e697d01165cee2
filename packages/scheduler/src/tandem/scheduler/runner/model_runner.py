"""Runs one ``ScheduledBatch`` on the forward stream: prepare, run the model, sample,
stash.

``launch`` builds the batch's input tensors on the schedule side (``step_inputs``) and
hands the step to the device's ``StepDriver``, which enqueues it and returns a
``LaunchedBatch`` at once; the host reads its results only after its copy-done event.
The driver is the one place the CPU (``cpu_step``) and accelerators (``device_step``)
differ: how copy-done is produced, and how a decode step is replayed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tandem.futuremap import DeviceStream, FutureMap, Stream
from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.kv.pools import PagedKVPool, ReqToTokenPool
from tandem.scheduler.messages import LaunchedBatch, SamplingInputs, ScheduledBatch, StepResult
from tandem.scheduler.models import CausalLM
from tandem.scheduler.parallel.distributed import StepRelay
from tandem.scheduler.runner.cpu_step import CpuStep, ForwardThreads
from tandem.scheduler.runner.cuda_graph import DecodeGraphRunner
from tandem.scheduler.runner.decode_trace import DecodeTrace
from tandem.scheduler.runner.device_step import DeviceStep
from tandem.scheduler.runner.step_inputs import StepInputs
from tandem.scheduler.runner.timeline import Timeline
from tandem.scheduler.sampling import PenaltyState, SampleOutput, Sampler
from tandem.scheduler.speculative.interface import (
    PrefillDraftInput,
    SpecDecodeInput,
    SpeculativeWorker,
)

INPUT_LOGPROB_BLOCK = 512
"""Prompt positions whose full-vocabulary logits exist at once, for prompt logprobs."""
_DECODE_MODES = (ForwardMode.DECODE, ForwardMode.SPEC_DECODE)


class StepDriver(Protocol):
    """How a step runs on the device's streams (``CpuStep``, ``DeviceStep``)."""

    def launch(self, batch: ScheduledBatch, run: Callable[[], StepResult]) -> LaunchedBatch:
        """Enqueue ``run`` (the batch's step) on the forward stream, with the event
        that says its results are on the host."""
        ...

    def forward_starts(self) -> None:
        """On the forward stream: the step's preparation is over (a speculative step)."""
        ...

    def replay(self, batch: ScheduledBatch, inputs: StepInputs) -> torch.Tensor | None:
        """A decode batch's logits from a captured step, or None (run it eagerly)."""
        ...

    def forward(
        self, fb: ForwardBatch, capture: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The model's forward of the planned batch (``CausalLM.forward_capture``)."""
        ...


class ModelRunner:
    """Owns the model and the device-side state one forward touches."""

    def __init__(
        self,
        model: CausalLM,
        req_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        attention: AttentionBackend,
        sampler: Sampler,
        penalties: PenaltyState,
        future_map: FutureMap,
        stream: Stream,
        spec: SpeculativeWorker | None = None,
        copy_stream: DeviceStream | None = None,
        graphs: DecodeGraphRunner | None = None,
        decode_trace: DecodeTrace | None = None,
        relay: StepRelay | None = None,
        forward_threads: ForwardThreads | None = None,
    ) -> None:
        self.model = model
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.attention = attention
        self.sampler = sampler
        self.penalties = penalties
        self.future_map = future_map
        self.stream = stream
        self.device = future_map.device
        self.timeline = Timeline(self.device)
        self.spec = spec
        self.graphs = graphs
        self.decode_trace = decode_trace
        self.relay = relay
        """Tensor parallelism's rank 0: where launched steps also go (the followers)."""
        self.driver: StepDriver
        self.copy_stream: DeviceStream | None = None  # the CPU's results are on the host
        if self.device.type == "cpu":
            self.driver = CpuStep(stream, model, attention, decode_trace, forward_threads)
        else:
            self.copy_stream = copy_stream if copy_stream is not None else DeviceStream(self.device)
            self.driver = DeviceStep(stream, self.copy_stream, model, attention, future_map, graphs)
        self._pin = self.device.type != "cpu"
        self.vocab_size = penalties.vocab_size
        # The CPU's forward stream is a thread, which can wait for a batch's grammar
        # masks at sampling; an accelerator's sampling is enqueued at launch.
        self.masks_wait_on_stream = self.device.type == "cpu"
        self._table_width = req_pool.req_to_token.shape[1]
        self._capture = spec.capture_layers if spec is not None else ()

    def launch(
        self, batch: ScheduledBatch, sampling: SamplingInputs | None, new_period: bool = False
    ) -> LaunchedBatch:
        """Enqueue the batch on the forward stream; returns without waiting. The
        batch's host tensors are built here, on the schedule side (``step_inputs``).
        ``new_period``: the scheduler was idle before this batch (for the timeline)."""
        if self.relay is not None:
            self.relay.launch(batch, sampling, new_period)
        inputs = StepInputs.build(batch, self._table_width, self._pin)
        run = functools.partial(self._timed_step, batch, inputs, sampling, new_period)
        return self.driver.launch(batch, run)

    def discard_rows(self, rows: list[int]) -> None:
        """Freed rows forget their futures, in stream order (after any queued read).
        Only the debug checks care, so without them nothing is enqueued."""
        if rows and self.future_map.debug:
            if self.relay is not None:
                self.relay.discard(rows)
            self.stream.submit(self.future_map.discard, rows)

    def share_masks(self, step: int, bitmask: torch.Tensor) -> None:
        """A launched batch's grammar masks, once written, to the follower ranks."""
        if self.relay is not None:
            self.relay.masks(step, bitmask)

    # -- on the forward stream --------------------------------------------------------------
    def _timed_step(
        self,
        batch: ScheduledBatch,
        inputs: StepInputs,
        sampling: SamplingInputs | None,
        new_period: bool,
    ) -> StepResult:
        # Decode steps are timed by kind and size for speculative decoding's gate.
        key = None
        if self.spec is not None and batch.mode in _DECODE_MODES:
            key = (batch.mode is ForwardMode.SPEC_DECODE, len(batch.reqs))
        handle = self.timeline.begin(new_period, key)
        try:
            return self._forward_step(batch, inputs, sampling)
        finally:
            self.timeline.end(handle)

    @torch.inference_mode()
    def _forward_step(
        self, batch: ScheduledBatch, inputs: StepInputs, sampling: SamplingInputs | None
    ) -> StepResult:
        # Prepare: the inputs on the device, the table entries written.
        inputs = inputs.on(self.device)
        self._write_tables(batch, inputs)
        if batch.prebuilt_rows:  # as if their prefill had run here
            self.future_map.stash(batch.prebuilt_rows, batch.prebuilt_tokens)
            self.future_map.publish(batch.prebuilt_rows, batch.prebuilt_lens)
        if batch.mode is ForwardMode.SPEC_DECODE:
            return self._spec_step(batch, inputs, sampling)
        logits = self.driver.replay(batch, inputs)
        if logits is not None:
            return self._sample_replayed(batch, inputs, sampling, logits)
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=self.future_map.resolve_mixed(
                inputs.prefill_tokens, inputs.decode_rows(batch.num_decode)
            ),
            positions=inputs.positions,
            rows=inputs.rows,
            seq_lens=inputs.seq_lens,
            prefix_lens=inputs.prefix_lens,
            extend_lens=inputs.extend_lens,
            out_cache_loc=inputs.out_cache_loc,
            seq_lens_cpu=inputs.seq_lens_cpu,
            extend_lens_cpu=batch.extend_lens,
            rows_cpu=batch.rows,
        )
        self.attention.plan(fb)
        # Run the model, then sample and stash the sampling requests' next tokens. A
        # speculative engine's draft reads the target's features after a prefill only,
        # of requests that will draft: its plain decode steps capture nothing (and so
        # may be replayed).
        drafts = self.spec is not None and batch.draft_prefill
        hidden, captured = self.driver.forward(fb, self._capture if drafts else ())
        next_ids = None
        if batch.sample_indices and sampling is not None:
            last = (
                hidden if inputs.every_token_samples else hidden.index_select(0, inputs.sample_last)
            )
            logits = self.model.compute_logits(last)
            next_ids, result = self._sample(batch, sampling, logits, inputs.sample_rows)
        else:
            result = StepResult(next_token_ids=torch.empty(0, dtype=torch.int64))
        if batch.input_logprob_tokens:
            self._input_logprobs(batch, hidden, result)
        if drafts:
            features = torch.cat(captured, dim=-1) if captured else hidden
            self._draft_after_prefill(batch, inputs, fb, features, next_ids)
        return result

    def _input_logprobs(
        self, batch: ScheduledBatch, hidden: torch.Tensor, result: StepResult
    ) -> None:
        """The batch's prompt logprobs into ``result``: the float32 log-softmax of the
        logits before each scored prompt token, gathered at it (and its top
        alternatives), ``INPUT_LOGPROB_BLOCK`` positions' full-vocabulary logits at a
        time. Only the positions asked for are projected to the vocabulary."""
        tokens = self._tensor(batch.input_logprob_tokens)
        targets = self._tensor(batch.input_logprob_targets)
        k = batch.input_logprob_top
        chosen, values, ids = [], [], []
        for lo in range(0, tokens.shape[0], INPUT_LOGPROB_BLOCK):
            rows = tokens[lo : lo + INPUT_LOGPROB_BLOCK]
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            picked = targets[lo : lo + INPUT_LOGPROB_BLOCK].unsqueeze(1)
            chosen.append(logprobs.gather(1, picked).squeeze(1))
            if k > 0:
                top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
                values.append(top.values)
                ids.append(top.indices)
            del logits, logprobs
        result.input_logprobs = torch.cat(chosen)
        if k > 0:
            result.input_top_values = torch.cat(values)
            result.input_top_ids = torch.cat(ids)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """An int list as a device tensor (the rare inputs ``StepInputs`` leaves out)."""
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    def _write_tables(self, batch: ScheduledBatch, inputs: StepInputs) -> None:
        """The batch's req_to_token entries and penalty resets, in stream order (a queued
        forward may still read the table)."""
        if batch.table_rows:
            table = self.req_pool.req_to_token
            slots = inputs.table_slots.to(table.dtype)
            table.view(-1).index_copy_(0, inputs.table_index, slots)
        for reset in batch.penalty_resets:
            outputs = self._tensor(reset.output_ids) if reset.output_ids else None
            self.penalties.reset_row(
                reset.row, self._tensor(reset.prompt_ids), reset.params, output_ids=outputs
            )

    def _sample(
        self,
        batch: ScheduledBatch,
        sampling: SamplingInputs,
        logits: torch.Tensor,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, StepResult]:
        """Sample the sampling rows' next tokens and stash them."""
        if batch.grammar is not None:
            masks = batch.grammar
            from tandem.scheduler.sampling.grammar import apply_bitmask  # xgrammar: on first use

            if not masks.ready.is_set():  # the host writes them while the forward runs
                waited = time.perf_counter()
                masks.ready.wait()
                self.timeline.stall(time.perf_counter() - waited)
            apply_bitmask(logits, masks.bitmask.to(logits.device), masks.rows)
        info = None if sampling.plain_greedy else sampling.build(self.device)
        if info is None:
            out = self.sampler.sample_greedy(logits)
        else:
            out = self.sampler.sample(logits, info, self.penalties)
        next_ids = out.next_token_ids
        self.future_map.stash(rows, next_ids)
        if info is not None and info.need_penalties:
            self.penalties.record(rows, next_ids)
        return next_ids, self._step_result(out, logits if batch.return_logits else None)

    def _sample_replayed(
        self,
        batch: ScheduledBatch,
        inputs: StepInputs,
        sampling: SamplingInputs | None,
        logits: torch.Tensor,
    ) -> StepResult:
        """Sample a replayed decode batch's logits (every request's, in batch order)."""
        if not batch.sample_indices or sampling is None:
            return StepResult(next_token_ids=torch.empty(0, dtype=torch.int64))
        # A decode request's one token is its last: sample_last is the batch index.
        if len(batch.sample_indices) != len(batch.rows):
            logits = logits.index_select(0, inputs.sample_last)
        elif batch.return_logits:
            logits = logits.clone()  # a replay's output is overwritten by the next replay
        return self._sample(batch, sampling, logits, inputs.sample_rows)[1]

    def _draft_after_prefill(
        self,
        batch: ScheduledBatch,
        inputs: StepInputs,
        fb: ForwardBatch,
        features: torch.Tensor,
        next_sampled: torch.Tensor | None,
    ) -> None:
        """Hand the prefill to the speculative worker: the chunk's tokens shifted by
        one (the draft at position p reads token p + 1), the sampled tokens
        (``next_sampled``) at the end of completed prompts."""
        assert self.spec is not None
        next_ids = torch.empty_like(fb.input_ids)
        next_ids[:-1] = fb.input_ids[1:]
        next_ids.index_copy_(0, fb.last_token_indices, self._tensor(batch.next_tokens))
        if next_sampled is not None:
            next_ids.index_copy_(0, inputs.sample_last, next_sampled)
        seq_lens = inputs.seq_lens_cpu
        self.spec.extend_after_prefill(
            PrefillDraftInput(
                batch=fb,
                next_ids=next_ids,
                features=features,
                sample_rows=inputs.sample_rows,
                sample_last=inputs.sample_last,
                sample_seq_lens=[seq_lens[i] for i in batch.sample_indices],
            )
        )

    def _spec_step(
        self, batch: ScheduledBatch, inputs: StepInputs, sampling: SamplingInputs | None
    ) -> StepResult:
        assert self.spec is not None
        assert sampling is not None
        self.driver.forward_starts()  # a speculative step is forwards throughout
        out = self.spec.decode(
            SpecDecodeInput(
                rows=inputs.rows,
                bounds=list(batch.spec_bounds),
                sampling=sampling.build(self.device),
                steps=list(batch.spec_steps),
                grammar=batch.grammar,
            )
        )
        return StepResult(next_token_ids=out.tokens, accept_lens=out.accept_lens)

    @staticmethod
    def _step_result(out: SampleOutput, logits: torch.Tensor | None) -> StepResult:
        top = out.top_logprobs
        return StepResult(
            next_token_ids=out.next_token_ids,
            logprobs=out.logprobs,
            top_logprob_values=top[0] if top is not None else None,
            top_logprob_ids=top[1] if top is not None else None,
            logits=logits,
        )
