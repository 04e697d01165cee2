"""A batch's host columns (``StepInputs``), built on the schedule side at launch: each
column holds the batch's list, the req_to_token entries become flat indices that
address the same cells, decode rows are the batch's last rows, and a decode batch
needs no gather before its logits; the forward reads the batch's own host lists."""

from __future__ import annotations

from typing import Any

import torch

from tandem.scheduler import Engine
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.messages import ScheduledBatch
from tandem.scheduler.runner.step_inputs import StepInputs

WIDTH = 32  # req_to_token's row length


def _mixed() -> ScheduledBatch:
    """Request at row 3 prefills 4 tokens after a cached prefix of 2 (not its last
    chunk: it samples nothing); rows 5 and 1 decode one token each."""
    return ScheduledBatch(
        ForwardMode.MIXED,
        reqs=[],
        prefix_lens=[2, 9, 4],
        extend_lens=[4, 1, 1],
        prefill_tokens=[11, 12, 13, 14],
        num_decode=2,
        positions=[2, 3, 4, 5, 9, 4],
        out_cache_loc=[40, 41, 42, 43, 70, 20],
        table_rows=[3, 3, 3, 3, 5, 1],
        table_cols=[2, 3, 4, 5, 9, 4],
        table_slots=[40, 41, 42, 43, 70, 20],
        sample_indices=[1, 2],
        rows=[3, 5, 1],
    )


def _decode() -> ScheduledBatch:
    return ScheduledBatch(
        ForwardMode.DECODE,
        reqs=[],
        prefix_lens=[7, 3],
        extend_lens=[1, 1],
        num_decode=2,
        positions=[7, 3],
        out_cache_loc=[50, 51],
        table_rows=[2, 4],
        table_cols=[7, 3],
        table_slots=[50, 51],
        sample_indices=[0, 1],
        rows=[2, 4],
    )


def test_columns_hold_the_batch_lists() -> None:
    batch = _mixed()
    columns = StepInputs.build(batch, WIDTH, pin=False).on(torch.device("cpu"))
    assert columns.prefill_tokens.tolist() == batch.prefill_tokens
    assert columns.positions.tolist() == batch.positions
    assert columns.rows.tolist() == batch.rows
    assert columns.seq_lens.tolist() == [6, 10, 5]
    assert columns.prefix_lens.tolist() == batch.prefix_lens
    assert columns.extend_lens.tolist() == batch.extend_lens
    assert columns.out_cache_loc.tolist() == batch.out_cache_loc
    assert columns.table_slots.tolist() == batch.table_slots
    # The decode requests' tokens are the 5th and 6th of the [T] layout.
    assert columns.sample_last.tolist() == [4, 5]
    assert columns.sample_rows.tolist() == [5, 1]
    assert columns.decode_rows(batch.num_decode).tolist() == [5, 1]
    assert columns.seq_lens_cpu == [6, 10, 5]
    assert all(c.dtype == torch.int64 for c in columns if isinstance(c, torch.Tensor))


def test_table_indices_address_the_same_cells() -> None:
    batch = _mixed()
    columns = StepInputs.build(batch, WIDTH, pin=False).on(torch.device("cpu"))
    flat = torch.zeros(8, WIDTH, dtype=torch.int32)
    slots = columns.table_slots.to(torch.int32)
    flat.view(-1).index_copy_(0, columns.table_index, slots)
    indexed = torch.zeros(8, WIDTH, dtype=torch.int32)
    indexed[batch.table_rows, batch.table_cols] = torch.tensor(batch.table_slots).int()
    assert torch.equal(flat, indexed)
    assert flat.count_nonzero() == len(batch.table_slots)


def test_a_decode_batch_needs_no_gather_before_its_logits() -> None:
    assert StepInputs.build(_decode(), WIDTH, pin=False).every_token_samples
    assert not StepInputs.build(_mixed(), WIDTH, pin=False).every_token_samples


def test_cpu_columns_are_the_host_views() -> None:
    inputs = StepInputs.build(_decode(), WIDTH, pin=False)
    assert inputs.on(torch.device("cpu")) is inputs
    assert sum(inputs.sizes) == inputs.host.numel()


def test_an_empty_batch_has_empty_columns() -> None:
    batch = ScheduledBatch(ForwardMode.DECODE, reqs=[], prefix_lens=[], extend_lens=[])
    inputs = StepInputs.build(batch, WIDTH, pin=False)
    assert inputs.host.numel() == 0
    assert all(c.numel() == 0 for c in inputs if isinstance(c, torch.Tensor))
    assert inputs.every_token_samples


def test_the_forward_reads_the_batch_lists() -> None:
    """The ``ForwardBatch`` attention plans from holds the launched batch's own host
    lists, not copies."""
    launched: list[ScheduledBatch] = []
    planned: list[ForwardBatch] = []
    with Engine(
        model_path="tandem-tiny", device="cpu", skip_tokenizer_init=True,
        disable_progress_bar=True, disable_overlap_schedule=True,
    ) as engine:  # fmt: skip
        runner = engine.scheduler.runner
        launch, plan = runner.launch, runner.attention.plan

        def spy_launch(batch: ScheduledBatch, *args: Any, **kwargs: Any) -> Any:
            launched.append(batch)
            return launch(batch, *args, **kwargs)

        def spy_plan(fb: ForwardBatch) -> None:
            planned.append(fb)
            plan(fb)

        runner.launch = spy_launch  # type: ignore[method-assign]
        runner.attention.plan = spy_plan  # type: ignore[method-assign]
        engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 3})
    assert len(planned) == len(launched) > 1
    for batch, fb in zip(launched, planned, strict=True):
        assert fb.rows_cpu is batch.rows
        assert fb.extend_lens_cpu is batch.extend_lens
        assert fb.seq_lens_cpu == batch.seq_lens
