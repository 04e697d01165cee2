"""Runs one ``ScheduledBatch`` on the forward stream: resolve, forward, sample, stash,
copy to host, record copy-done.

``launch`` turns the batch's lists into one host tensor on the schedule side
(``step_inputs``); everything in ``_forward_step`` is device work enqueued in stream
order (on the CPU it runs on the host stream's worker thread). The host gets a
``LaunchedBatch`` back at once and touches its results only after waiting on its
copy-done event.

On an accelerator the batch's host inputs travel from pinned memory without blocking,
and its outputs go back on a separate copy stream into pinned memory: the copy stream
waits for the forward stream's sampling, the copy-done event is recorded on the copy
stream, and the forward stream is free to start the next batch at once. Decode
batches replay a captured CUDA graph when a ``DecodeGraphRunner`` is given; on the CPU,
decode steps that continue their decode stage replay a traced forward when a
``DecodeTrace`` is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.futuremap import DeviceStream, FutureMap, Stream
from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.cuda_graph import DecodeGraphRunner
from tandem.scheduler.decode_trace import DecodeTrace
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.handoff import Handoff, StepDone
from tandem.scheduler.memory import PagedKVPool, ReqToTokenPool
from tandem.scheduler.messages import LaunchedBatch, SamplingSpec, ScheduledBatch, StepResult
from tandem.scheduler.models import CausalLM
from tandem.scheduler.sampling import (
    PenaltyState,
    SampleOutput,
    Sampler,
)
from tandem.scheduler.speculative import PrefillDraftInput, SpecDecodeInput, SpeculativeWorker
from tandem.scheduler.step_inputs import StepColumns, StepInputs
from tandem.scheduler.timeline import Timeline


@dataclass(frozen=True)
class _Sampled:
    """Device indices of a batch's sampling requests: the position of each one's last
    token in the ``[T]`` layout (None when every token samples, in order) and its row."""

    last: torch.Tensor | None
    rows: torch.Tensor


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
        # Device-to-host copies: a copy stream on accelerators (None on the CPU, where
        # the forward stream's results are host tensors already).
        self.copy_stream = copy_stream
        self.graphs = graphs
        self.decode_trace = decode_trace
        self._pin = self.device.type != "cpu"
        # The CPU (no copy stream): the worker sets each batch's copy-done itself.
        self._handoff = Handoff() if copy_stream is None else None

    def launch(
        self, batch: ScheduledBatch, sampling: SamplingSpec | None, new_period: bool = False
    ) -> LaunchedBatch:
        """Enqueue the batch on the forward stream; returns without waiting. The
        batch's host tensors are built here, on the schedule side (``step_inputs``).
        ``new_period``: the scheduler was idle before this batch (for the timeline)."""
        inputs = StepInputs.build(batch, self.req_pool.req_to_token.shape[1], self._pin)
        if self._handoff is not None:
            # The CPU: the step's outputs are host tensors already, and its copy-done
            # is set by the worker (see ``handoff``).
            done = self._handoff.launch()
            work = self.stream.submit(self._timed_step, batch, inputs, sampling, new_period, done)
            return LaunchedBatch(batch, work, done)
        work = self.stream.submit(self._timed_step, batch, inputs, sampling, new_period)
        # An accelerator stream runs the submitted step at once (it only enqueues), so
        # its device outputs exist now: copy them on the copy stream after the forward.
        self.copy_stream.wait_stream(self.stream)
        host = self.copy_stream.submit(self._copy_out, work.result())
        return LaunchedBatch(batch, host, self.copy_stream.record_event())

    def discard_rows(self, rows: list[int]) -> None:
        """Freed rows forget their futures, in stream order (after any queued read).
        Only the debug checks care, so without them nothing is enqueued."""
        if rows and self.future_map.debug:
            self.stream.submit(self.future_map.discard, rows)

    # -- on the forward stream --------------------------------------------------------------
    def _tensor(self, values: list[int]) -> torch.Tensor:
        """An int list as a device tensor (the rare inputs ``StepInputs`` leaves out)."""
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    def _write_tables(self, batch: ScheduledBatch, columns: StepColumns) -> None:
        """The batch's req_to_token entries and penalty resets, in stream order (a queued
        forward may still read the table)."""
        if batch.table_rows:
            table = self.req_pool.req_to_token
            slots = columns.table_slots.to(table.dtype)
            table.view(-1).index_copy_(0, columns.table_index, slots)
        for reset in batch.penalty_resets:
            outputs = self._tensor(reset.output_ids) if reset.output_ids else None
            self.penalties.reset_row(
                reset.row, self._tensor(reset.prompt_ids), reset.params, output_ids=outputs
            )

    def _prepare_eager(
        self, batch: ScheduledBatch, inputs: StepInputs, columns: StepColumns
    ) -> tuple[ForwardBatch, _Sampled]:
        """The batch's ``ForwardBatch`` and sampling indices, from its columns."""
        input_ids = self.future_map.resolve_mixed(
            columns.prefill_tokens, columns.decode_rows(batch.num_decode)
        )
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=input_ids,
            positions=columns.positions,
            rows=columns.rows,
            seq_lens=columns.seq_lens,
            prefix_lens=columns.prefix_lens,
            extend_lens=columns.extend_lens,
            out_cache_loc=columns.out_cache_loc,
            seq_lens_cpu=batch.seq_lens,
            extend_lens_cpu=list(batch.extend_lens),
            rows_cpu=list(batch.rows),
        )
        last = None if inputs.every_token_samples else columns.sample_last
        return fb, _Sampled(last, columns.sample_rows)

    def _timed_step(
        self,
        batch: ScheduledBatch,
        inputs: StepInputs,
        sampling: SamplingSpec | None,
        new_period: bool,
        done: StepDone | None = None,
    ) -> StepResult:
        handle = self.timeline.begin(new_period)
        if self._handoff is not None:
            self._handoff.start()
        try:
            return self._forward_step(batch, inputs, sampling)
        finally:
            self.timeline.end(handle)
            if self._handoff is not None and done is not None:
                self._handoff.finish(done)

    @torch.inference_mode()
    def _forward_step(
        self, batch: ScheduledBatch, inputs: StepInputs, sampling: SamplingSpec | None
    ) -> StepResult:
        columns = inputs.on(self.device)
        self._write_tables(batch, columns)
        if batch.mode is ForwardMode.SPEC_DECODE:
            if self._handoff is not None:
                self._handoff.release()  # a speculative step is forwards throughout
            return self._spec_step(batch, columns, sampling)
        if self._graph_fits(batch):
            return self._graph_step(batch, columns, sampling)
        fb, sampled = self._prepare_eager(batch, inputs, columns)
        self.attention.plan(fb)
        capture = self.spec.capture_layers if self.spec is not None else ()
        hidden, captured = self._forward(fb, capture)
        next_ids = None
        result = StepResult(next_token_ids=torch.empty(0, dtype=torch.int64))
        if batch.sample_indices and sampling is not None:
            last = hidden if sampled.last is None else hidden.index_select(0, sampled.last)
            logits = self.model.compute_logits(last)
            next_ids, result = self._sample(batch, sampling, logits, sampled.rows)
        if self.spec is not None:
            features = torch.cat(captured, dim=-1) if captured else hidden
            self._draft_after_prefill(batch, fb, features, next_ids, sampled)
        return result

    def _forward(
        self, fb: ForwardBatch, capture: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The model's forward of the planned batch: replayed by the decode trace when
        the step is one it covers, else eager."""
        if self._handoff is not None:
            self._handoff.release()  # the host's work now runs beside this forward
        if self.decode_trace is not None and not capture:
            hidden = self.decode_trace.forward(fb)
            if hidden is not None:
                return hidden, []
        return self.model.forward_capture(fb.input_ids, fb.positions, self.attention, capture)

    def _sample(
        self,
        batch: ScheduledBatch,
        sampling: SamplingSpec,
        logits: torch.Tensor,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, StepResult]:
        """Sample the sampling rows' next tokens, stash them, start their host copy."""
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

    def _graph_fits(self, batch: ScheduledBatch) -> bool:
        return (
            self.graphs is not None
            and batch.mode is ForwardMode.DECODE
            and self.graphs.padded_size(len(batch.rows)) is not None
        )

    def _graph_step(
        self, batch: ScheduledBatch, columns: StepColumns, sampling: SamplingSpec | None
    ) -> StepResult:
        """A decode batch through its captured graph: the FutureMap resolves the input
        ids on this stream, the graph replays, the sampling rows' logits are sampled."""
        assert self.graphs is not None
        input_ids = self.future_map.resolve_tokens(columns.decode_rows(batch.num_decode))
        logits = self.graphs.replay(
            input_ids, batch.positions, batch.rows, batch.seq_lens, batch.out_cache_loc
        )
        if not batch.sample_indices or sampling is None:
            return StepResult(next_token_ids=torch.empty(0, dtype=torch.int64))
        # A decode request's one token is its last: sample_last is the batch index.
        indices, rows = columns.sample_last, columns.sample_rows
        if len(batch.sample_indices) != len(batch.rows):
            logits = logits.index_select(0, indices)
        elif batch.return_logits:
            logits = logits.clone()  # the graph's output is overwritten by the next replay
        return self._sample(batch, sampling, logits, rows)[1]

    def _draft_after_prefill(
        self,
        batch: ScheduledBatch,
        fb: ForwardBatch,
        features: torch.Tensor,
        next_sampled: torch.Tensor | None,
        sampled: _Sampled,
    ) -> None:
        """Hand the prefill to the speculative worker: the chunk's tokens shifted by
        one (the draft at position p reads token p + 1), the sampled tokens
        (``next_sampled``) at the end of completed prompts."""
        assert self.spec is not None
        last = fb.last_token_indices
        next_ids = torch.empty_like(fb.input_ids)
        next_ids[:-1] = fb.input_ids[1:]
        next_ids.index_copy_(0, last, self._tensor(batch.next_tokens))
        # None: every token samples, in order, so each one is its request's last.
        sample_last = last if sampled.last is None else sampled.last
        if next_sampled is not None:
            next_ids.index_copy_(0, sample_last, next_sampled)
        seq_lens = batch.seq_lens
        self.spec.extend_after_prefill(
            PrefillDraftInput(
                batch=fb,
                next_ids=next_ids,
                features=features,
                sample_rows=sampled.rows,
                sample_last=sample_last,
                sample_seq_lens=[seq_lens[i] for i in batch.sample_indices],
            )
        )

    def _spec_step(
        self, batch: ScheduledBatch, columns: StepColumns, sampling: SamplingSpec | None
    ) -> StepResult:
        assert self.spec is not None
        assert sampling is not None
        out = self.spec.decode(
            SpecDecodeInput(
                rows=columns.rows,
                bounds=list(batch.spec_bounds),
                sampling=sampling.build(self.device),
                steps=list(batch.spec_steps),
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

    def _copy_out(self, result: StepResult) -> StepResult:
        """On the copy stream: ``result``'s device tensors copied into pinned host
        memory without blocking (read after copy-done). Each source is marked as used by
        the copy stream, so the caching allocator does not hand its memory to the next
        batch before the copy has read it."""
        assert self.copy_stream is not None
        raw = self.copy_stream.raw

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":  # None, or an empty host placeholder
                return t
            t.record_stream(raw)
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        fields = dataclasses.fields(result)
        return dataclasses.replace(
            result, **{f.name: host(getattr(result, f.name)) for f in fields}
        )
