"""A batch's integer inputs as one host tensor, built when the batch is launched.

A ``ScheduledBatch`` holds Python lists; the forward needs tensors. Turning a dozen
short lists into tensors costs tens of microseconds of Python and allocation, whatever
the lists' length, and a small model's decode step feels that. Where it runs matters
on the CPU: the forward stream is a worker thread, and everything it does comes before
the forward. So the lists become tensors in ``ModelRunner.launch``, on the schedule
side: in the overlap loop that is while the previous batch's forward runs, where the
device does not wait for it. The forward stream only reads the columns (on an
accelerator, after one non-blocking copy of the pinned host tensor, as before).

Nothing here reads the device or shared device state: ``StepInputs.build`` is a pure
function of the batch, so building it on the schedule side is safe whatever the
forward stream is doing. Writes to shared tables (``req_to_token``) stay on the
forward stream, in stream order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.scheduler.messages import ScheduledBatch


class StepColumns(NamedTuple):
    """A batch's int64 columns (see ``ScheduledBatch`` for each list).

    ``table_index`` is each ``req_to_token`` entry to write as a flat index
    (``row * width + col``), so the write is one ``index_copy_`` into the flattened
    table instead of advanced indexing, which costs several times more on the CPU.
    ``sample_last`` is the position, in the ``[T]`` token layout, of each sampling
    request's last token."""

    table_index: torch.Tensor
    table_slots: torch.Tensor
    prefill_tokens: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    sample_last: torch.Tensor
    sample_rows: torch.Tensor

    def decode_rows(self, count: int) -> torch.Tensor:
        """The rows of the batch's decode requests, which come last (``ForwardMode``)."""
        return self.rows[self.rows.shape[0] - count :]


@dataclass(frozen=True)
class StepInputs:
    """The columns of one batch in one host tensor (pinned on accelerators).

    Attributes:
        host: every column, concatenated.
        sizes: each column's length, in ``StepColumns`` order.
        host_columns: ``host`` split into columns (views; what a CPU step reads).
        every_token_samples: every new token samples, in order (a decode batch), so
            the hidden states need no gather before the logits.
    """

    host: torch.Tensor
    sizes: tuple[int, ...]
    host_columns: StepColumns
    every_token_samples: bool

    @classmethod
    def build(cls, batch: ScheduledBatch, table_width: int, pin: bool) -> StepInputs:
        """The batch's columns; ``table_width`` is ``req_to_token``'s row length."""
        ends = list(itertools.accumulate(batch.extend_lens))
        sample_last = [ends[i] - 1 for i in batch.sample_indices]
        columns = (
            [r * table_width + c for r, c in zip(batch.table_rows, batch.table_cols, strict=True)],
            batch.table_slots, batch.prefill_tokens, batch.positions, batch.rows,
            batch.seq_lens, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
            sample_last, batch.sample_rows,
        )  # fmt: skip
        sizes = tuple(len(c) for c in columns)
        host = torch.tensor(
            list(itertools.chain.from_iterable(columns)), dtype=torch.int64, pin_memory=pin
        )
        total = ends[-1] if ends else 0
        every = len(sample_last) == total and sample_last == list(range(total))
        return cls(host, sizes, StepColumns(*host.split(sizes)), every)

    def on(self, device: torch.device) -> StepColumns:
        """The columns on ``device`` (on the forward stream): the host views on the CPU,
        else one non-blocking copy of ``host``, split."""
        if device.type == "cpu":
            return self.host_columns
        return StepColumns(*self.host.to(device, non_blocking=True).split(self.sizes))
