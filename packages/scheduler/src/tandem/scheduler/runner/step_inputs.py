"""A batch's integer inputs as one host tensor, built when the batch is launched.

Turning a batch's dozen short lists into tensors costs tens of microseconds of Python
whatever their length, so ``ModelRunner.launch`` does it on the schedule side, where
the overlap loop has time while the previous forward runs, rather than on the forward
stream (on the CPU, the worker thread's stretch before the forward). ``build`` is a pure
function of the batch: it reads no device state. Writes to shared tables
(``req_to_token``) stay on the forward stream, in stream order.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from tandem.scheduler.messages import ScheduledBatch


class StepInputs(NamedTuple):
    """A batch's int64 columns (see ``ScheduledBatch`` for each list), views of one
    host tensor (pinned on accelerators; ``on`` moves it with one copy).

    ``table_index`` is each ``req_to_token`` entry to write as a flat index
    (``row * width + col``): one ``index_copy_`` into the flattened table, several
    times cheaper on the CPU than advanced indexing. ``sample_last`` is the position,
    in the ``[T]`` token layout, of each sampling request's last token."""

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
    seq_lens_cpu: list[int]  # ``seq_lens`` as the host list (computed once, here)
    every_token_samples: bool  # every new token samples, in order: no gather for logits
    host: torch.Tensor  # every column above, concatenated
    sizes: tuple[int, ...]  # each column's length

    @classmethod
    def build(cls, batch: ScheduledBatch, table_width: int, pin: bool) -> StepInputs:
        """The batch's columns; ``table_width`` is ``req_to_token``'s row length."""
        ends = list(itertools.accumulate(batch.extend_lens))
        sample_last = [ends[i] - 1 for i in batch.sample_indices]
        seq_lens = batch.seq_lens
        columns = (
            [r * table_width + c for r, c in zip(batch.table_rows, batch.table_cols, strict=True)],
            batch.table_slots, batch.prefill_tokens, batch.positions, batch.rows,
            seq_lens, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
            sample_last, batch.sample_rows,
        )  # fmt: skip
        sizes = tuple(len(c) for c in columns)
        host = torch.tensor(
            list(itertools.chain.from_iterable(columns)), dtype=torch.int64, pin_memory=pin
        )
        total = ends[-1] if ends else 0
        every = len(sample_last) == total and sample_last == list(range(total))
        return cls._make((*host.split(sizes), seq_lens, every, host, sizes))

    def on(self, device: torch.device) -> StepInputs:
        """The inputs on ``device`` (on the forward stream): these very views on the
        CPU, else one non-blocking copy of ``host``, split."""
        if device.type == "cpu":
            return self
        moved = self.host.to(device, non_blocking=True).split(self.sizes)
        host_side = (self.seq_lens_cpu, self.every_token_samples, self.host, self.sizes)
        return StepInputs._make((*moved, *host_side))

    def decode_rows(self, count: int) -> torch.Tensor:
        """The rows of the batch's decode requests, which come last (``ForwardMode``)."""
        return self.rows[self.rows.shape[0] - count :]
