"""How a step runs on an accelerator: the ``ModelRunner``'s step driver for a device
stream.

Submitting a step only enqueues its kernels, so its device outputs exist at once: they
go back on a separate copy stream into pinned host memory, the copy stream waits for
the forward stream's sampling, and the copy-done event is recorded on the copy stream,
leaving the forward stream free to start the next batch. A decode batch that fits a
captured size replays its CUDA graph (``DecodeGraphRunner``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tandem.futuremap import DeviceStream, FutureMap, Stream
from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.messages import LaunchedBatch, ScheduledBatch, StepResult
from tandem.scheduler.models import CausalLM
from tandem.scheduler.runner.cuda_graph import DecodeGraphRunner
from tandem.scheduler.runner.step_inputs import StepInputs


class DeviceStep:
    """The step driver of an accelerator (see ``model_runner.StepDriver``)."""

    def __init__(
        self,
        stream: Stream,
        copy_stream: DeviceStream,
        model: CausalLM,
        attention: AttentionBackend,
        future_map: FutureMap,
        graphs: DecodeGraphRunner | None,
    ) -> None:
        self.stream = stream
        self.copy_stream = copy_stream
        self.model = model
        self.attention = attention
        self.future_map = future_map
        self.graphs = graphs

    def launch(self, batch: ScheduledBatch, run: Callable[[], StepResult]) -> LaunchedBatch:
        work = self.stream.submit(run)
        # The stream ran the submitted step at once (it only enqueues), so its device
        # outputs exist now: copy them on the copy stream after the forward.
        self.copy_stream.wait_stream(self.stream)
        host = self.copy_stream.submit(self._copy_out, work.result())
        return LaunchedBatch(batch, host, self.copy_stream.record_event())

    def forward_starts(self) -> None:
        """Nothing to hand over: the host never waits on the forward stream itself."""

    def replay(self, batch: ScheduledBatch, inputs: StepInputs) -> torch.Tensor | None:
        """The logits ``[B, vocab]`` of a decode batch replayed through its captured
        graph (its input ids resolved from the FutureMap on this stream), or None: the
        batch runs eagerly. The logits are overwritten by the next replay."""
        graphs = self.graphs
        if (
            graphs is None
            or batch.mode is not ForwardMode.DECODE
            or graphs.padded_size(len(batch.rows)) is None
        ):
            return None
        input_ids = self.future_map.resolve_tokens(inputs.decode_rows(batch.num_decode))
        return graphs.replay(
            input_ids, batch.positions, batch.rows, inputs.seq_lens_cpu, batch.out_cache_loc
        )

    def forward(
        self, fb: ForwardBatch, capture: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The model's forward of the planned batch, eager."""
        return self.model.forward_capture(fb.input_ids, fb.positions, self.attention, capture)

    def _copy_out(self, result: StepResult) -> StepResult:
        """On the copy stream: ``result``'s device tensors copied into pinned host
        memory without blocking (read after copy-done). Each source is marked as used by
        the copy stream, so the caching allocator does not hand its memory to the next
        batch before the copy has read it."""
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
