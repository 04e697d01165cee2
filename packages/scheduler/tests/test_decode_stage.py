"""The decode stage (a CPU decode batch's K/V kept across steps): the engine's tokens
are those of the gather-every-step path while requests leave the batch one by one, in
both loops; the stage continues only a step of its rows (or some of them, the others
dropped) one token longer, and any
other plan drops it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from tandem.scheduler import Engine
from tandem.scheduler.attention import decode_stage
from tandem.scheduler.attention.decode_stage import DecodeStage, capacity_for, stage_fits
from tandem.scheduler.attention.torch_backend import TorchAttention

# Output lengths that differ, so the batch loses a request every few steps and the stage
# restarts; one long enough to outgrow the first stage's capacity (128 keys of room).
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(6)]
OUTPUT_LENS = [3, 40, 9, 150, 1, 25]


def _run(overlap: bool, stage: bool) -> list[list[int]]:
    engine = Engine(
        device="cpu",
        dtype="float32",
        disable_overlap_schedule=not overlap,
        skip_tokenizer_init=True,
        disable_progress_bar=True,
    )
    try:
        attention = engine.scheduler.runner.attention
        assert isinstance(attention, TorchAttention)
        attention.decode_stage = stage
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in OUTPUT_LENS]
        results = engine.generate(input_ids=PROMPTS, sampling_params=params)
    finally:
        engine.shutdown()
    return [r["output_ids"] for r in results]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_staged_tokens_equal_gathered_tokens(
    overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    advance, start = DecodeStage.advance, DecodeStage._start

    def counted_advance(self: DecodeStage, *args: Any) -> None:
        calls["advance"] += 1
        advance(self, *args)

    def counted_start(self: DecodeStage, gathered: torch.Tensor) -> torch.Tensor:
        calls["start"] += 1
        return start(self, gathered)

    monkeypatch.setattr(DecodeStage, "advance", counted_advance)
    monkeypatch.setattr(DecodeStage, "_start", counted_start)
    staged = _run(overlap, stage=True)
    used = dict(calls)
    calls.clear()
    gathered = _run(overlap, stage=False)
    assert staged == gathered
    assert [len(ids) for ids in staged] == OUTPUT_LENS
    assert calls == {}, "with the stage off nothing is staged"
    # Most steps continue the stage; it restarts when a request leaves and when the
    # longest request outgrows the capacity.
    assert used["advance"] > 100
    assert 0 < used["start"] < used["advance"]


def test_only_the_stage_rows_in_order_one_token_longer_continue() -> None:
    stage = DecodeStage(rows=[3, 5, 8], seq_lens=[10, 20, 30], capacity=capacity_for(30))
    assert stage.capacity == 192
    assert stage.continues([3, 5, 8], [11, 21, 31])
    assert stage.continues([3, 8], [11, 31])  # 5 left the batch
    assert stage.continues([5], [21])
    assert not stage.continues([8, 3], [31, 11])  # another order
    assert not stage.continues([3, 6], [11, 21])  # another row
    assert not stage.continues([3, 5, 8, 9], [11, 21, 31, 5])  # a request joined
    assert not stage.continues([3, 5, 8], [11, 22, 31])  # not one token longer
    assert not stage.continues([3, 5, 8], [10, 20, 30])
    assert not stage.continues([], [])
    assert not DecodeStage([3], [191], 192).continues([3], [193])  # past the capacity


def test_advance_indexes_each_requests_new_key_per_head() -> None:
    stage = DecodeStage(rows=[1, 2], seq_lens=[4, 7], capacity=64)
    stage.advance([1, 2], [5, 8], num_kv_heads=2, device=torch.device("cpu"))
    assert stage.append is not None
    # [B, Hkv, capacity] flattened: request-major, then head, then position.
    assert stage.append.tolist() == [4, 64 + 4, 128 + 7, 192 + 7]


def test_advance_drops_the_rows_that_left() -> None:
    stage = DecodeStage(rows=[1, 2, 3], seq_lens=[4, 7, 9], capacity=64)
    keys = torch.randn(3, 2, 64, 4)
    stage.keys[0], stage.values[0] = keys, keys + 1
    stage.advance([1, 3], [5, 10], num_kv_heads=2, device=torch.device("cpu"))
    assert stage.rows == [1, 3]
    torch.testing.assert_close(stage.keys[0], keys[[0, 2]])
    torch.testing.assert_close(stage.values[0], keys[[0, 2]] + 1)
    assert stage.append is not None
    assert stage.append.tolist() == [4, 64 + 4, 128 + 9, 192 + 9]


def test_a_new_stage_zeroes_keys_past_the_longest_sequence() -> None:
    stage = DecodeStage(rows=[1, 2], seq_lens=[3, 5], capacity=64)
    gathered = torch.randn(2, 5, 2, 4)
    k, v = stage.start(0, (gathered, gathered + 1))
    assert k.shape == v.shape == (2, 2, 5, 4)
    torch.testing.assert_close(k, gathered.transpose(1, 2))
    assert torch.count_nonzero(stage.keys[0][:, :, 5:]) == 0


def test_the_stage_is_bounded_in_memory() -> None:
    limit = decode_stage.LAYER_MAX_BYTES
    # keys and values, float32: 2 * B * Hkv * capacity * D * 4 bytes
    assert stage_fits(16, 512, 2, 16, 4)
    assert not stage_fits(16, 1024, 2, 64, 4)
    assert stage_fits(1, limit // (2 * 4 * 64), 1, 64, 4)
    assert not stage_fits(1, limit // (2 * 4 * 64) + 1, 1, 64, 4)
