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
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool, ReqToTokenPool

# Output lengths that differ, so the batch loses a request every few steps and the stage
# restarts; one long enough to outgrow the first stage's capacity (128 keys of room).
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(6)]
OUTPUT_LENS = [3, 40, 9, 150, 1, 25]


def _run(overlap: bool, stage: bool, dtype: str = "float32") -> list[list[int]]:
    engine = Engine(
        model_path="tandem-tiny",
        device="cpu",
        dtype=dtype,
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
    stage = DecodeStage(rows=[3, 5, 8], seq_lens=[10, 20, 30], capacity=capacity_for(30, False))
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


def test_a_stage_attended_whole_keeps_less_room() -> None:
    # Cut stages keep 128 keys of room, rounded up to 64; whole ones 32.
    assert [capacity_for(n, False) for n in (1, 64, 97, 128)] == [192, 192, 256, 256]
    assert [capacity_for(n, True) for n in (1, 32, 33, 97, 193)] == [64, 64, 128, 192, 256]


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
    assert k.shape == v.shape == (2, 2, 64, 4)
    assert k is stage.keys[0]
    assert v is stage.values[0]
    torch.testing.assert_close(k[:, :, :5], gathered.transpose(1, 2))
    assert torch.count_nonzero(k[:, :, 5:]) == 0


def test_the_stage_is_bounded_in_memory() -> None:
    limit = decode_stage.MAX_BYTES
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    per_key = 2 * 4 * 2 * 64 * 4  # keys and values of every layer, float32
    assert layout.bytes_per_token == per_key
    assert stage_fits(64, 1024, layout)
    assert stage_fits(1, limit // per_key, layout)
    assert not stage_fits(1, limit // per_key + 1, layout)
    assert not stage_fits(limit // (per_key * 512) + 1, 512, layout)


# The radix-cache regression: a repeated prompt is served from the cache but for its
# last token, so its prefill is one token, planned like a decode step. Admitted on the
# row a request has just left, at that request's last length plus one, it must not
# continue the departed request's stage (it did, and read the other request's K/V).
REPEATED = [(11 * j) % 250 + 3 for j in range(49)]
SHORTER = [(13 * j + 7) % 250 + 3 for j in range(49 - 16)]  # its last step: length 48


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_one_token_prefill_on_a_departed_rows_stage_starts_a_new_one(overlap: bool) -> None:
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with Engine(
        model_path="tandem-tiny",
        device="cpu",
        dtype="float32",
        disable_overlap_schedule=not overlap,
        skip_tokenizer_init=True,
        disable_progress_bar=True,
    ) as engine:
        first = engine.generate(input_ids=REPEATED, sampling_params=greedy)
        engine.generate(input_ids=SHORTER, sampling_params=greedy)  # row 1, then freed
        again = engine.generate(input_ids=REPEATED, sampling_params=greedy)
    assert again["meta_info"]["cached_tokens"] == len(REPEATED) - 1
    assert again["output_ids"] == first["output_ids"]


def test_a_stage_continued_for_another_request_fails_the_check() -> None:
    """The debug invariant: a stage that no longer matches the paged cache (here, a
    row whose table points at other slots, as after a new request took the row)."""
    layers, heads, dim = 2, 2, 4
    k_cache = [torch.randn(32, heads, dim) for _ in range(layers)]
    v_cache = [torch.randn(32, heads, dim) for _ in range(layers)]

    class Cache:
        def k_buffer(self, layer: int) -> torch.Tensor:
            return k_cache[layer]

        def v_buffer(self, layer: int) -> torch.Tensor:
            return v_cache[layer]

    table = torch.zeros(4, 16, dtype=torch.int32)
    table[1, :5] = torch.tensor([3, 4, 5, 6, 7])
    table[2, :3] = torch.tensor([10, 11, 12])
    stage = DecodeStage(rows=[1, 2], seq_lens=[5, 3], capacity=64)
    for layer in range(layers):
        slots = table[[1, 2], :5].long()
        gathered = (k_cache[layer][slots], v_cache[layer][slots])
        stage.start(layer, gathered)
    stage.advance([1, 2], [6, 4], num_kv_heads=heads, device=torch.device("cpu"))
    stage.check(Cache(), table)  # consistent: the stage is the cache
    table[2, 1] = 20  # row 2 now maps position 1 to another request's slot
    with pytest.raises(RuntimeError, match=r"row 2 \(seq_len 4\).*position 1;"):
        stage.check(Cache(), table)


def test_bfloat16_decode_attends_the_whole_stage_as_a_reference_does() -> None:
    """A bfloat16 decode batch attends over its stage's whole capacity (two matrix
    products on contiguous operands), each request's keys past its length masked: the
    result is attention over that request's keys alone, on the step that starts the
    stage and on the steps that continue it."""
    heads, kv_heads, dim, scale = 6, 2, 16, 0.25
    layout = KVLayout(1, kv_heads, dim, torch.bfloat16)
    kv, pool = PagedKVPool(256, 4, layout, "cpu"), ReqToTokenPool(4, 256, "cpu")
    gen = torch.Generator().manual_seed(0)
    starts = [9, 30, 17]  # prompt lengths: the batch's keys differ in length
    rows, slots = [], []
    for length in starts:
        row = pool.alloc()
        pages = kv.alloc_pages(kv.pages_for(length + 8))
        assert row is not None
        assert pages is not None
        row_slots = kv.slots(pages, 0, length + 8)
        pool.req_to_token[row, : len(row_slots)] = torch.tensor(row_slots, dtype=torch.int32)
        prompt = row_slots[:length]
        kv.k_buffer(0)[prompt] = torch.randn(length, kv_heads, dim, generator=gen).bfloat16()
        kv.v_buffer(0)[prompt] = torch.randn(length, kv_heads, dim, generator=gen).bfloat16()
        rows.append(row)
        slots.append(row_slots)
    backend = TorchAttention(kv, pool.req_to_token)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    for step in range(4):
        seq = [length + step + 1 for length in starts]
        locs = [row_slots[s - 1] for row_slots, s in zip(slots, seq, strict=True)]
        batch = ForwardBatch(
            ForwardMode.DECODE, t([0, 0, 0]), t([s - 1 for s in seq]), t(rows), t(seq),
            t([s - 1 for s in seq]), t([1, 1, 1]), t(locs), seq, [1, 1, 1], rows,
        )  # fmt: skip
        backend.plan(batch)
        assert (backend.staged_decode() is not None) == (step > 0)
        q = torch.randn(3, heads, dim, generator=gen).bfloat16()
        k = torch.randn(3, kv_heads, dim, generator=gen).bfloat16()
        v = torch.randn(3, kv_heads, dim, generator=gen).bfloat16()
        got = backend.forward(0, q, k, v, scale)
        assert got.dtype == torch.bfloat16
        assert got.shape == (3, heads * dim)
        for i, (row_slots, s) in enumerate(zip(slots, seq, strict=True)):
            keys = kv.k_buffer(0)[row_slots[:s]].double().repeat_interleave(3, 1)
            values = kv.v_buffer(0)[row_slots[:s]].double().repeat_interleave(3, 1)
            weights = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), keys) * scale, -1)
            want = torch.einsum("hl,lhd->hd", weights, values).reshape(-1)
            torch.testing.assert_close(got[i].double(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_bfloat16_staged_tokens_equal_gathered_tokens(overlap: bool) -> None:
    """The whole-stage bfloat16 path against the same engine gathering every step
    (attention cut to the longest sequence)."""
    assert _run(overlap, stage=True, dtype="bfloat16") == _run(
        overlap, stage=False, dtype="bfloat16"
    )
