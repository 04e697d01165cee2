"""Scheduling policy against a fake model runner: no model, no forward, tokens decided
by a function the test controls (``token(rid, i)`` is request ``rid``'s ``i``-th output).

The fake runner is a strict device stand-in. On every launch it checks that each row
reads, for every position below its prefix length, KV slots holding exactly the tokens
of its sequence (the prompt, then the outputs the token function gives), writes only
the positions the batch extends, that prefill tokens are that sequence and that the
sampling step index is the output index. Rows are reused only after every batch that
used them has settled. Each test ends with the scheduler idle, ``check_accounting``
passing (``strict_accounting=True`` also runs it and the page ledger at each idle),
every row free and no KV page lost.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tandem.futuremap import HostEvent, Work
from tandem.scheduler.config import EngineConfig
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool, ReqToTokenPool
from tandem.scheduler.messages import (
    LaunchedBatch,
    SamplingInputs,
    ScheduledBatch,
    StepResult,
    Update,
)
from tandem.scheduler.request import Request
from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.schedule.scheduler import Scheduler
from tandem.scheduler.text.stop import StopChecker

EOS = 2
STOP = 7  # a stop_token_ids entry in the tests that use one
LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])

TokenFn = Callable[[str, int], int]


def plain_token(rid: str, i: int) -> int:
    """A token that is never EOS or STOP, distinct per (rid, i)."""
    return 100 + (sum(map(ord, rid)) * 31 + i * 7) % 800


def stopping_at(stops: dict[str, tuple[int, int]]) -> TokenFn:
    """``plain_token``, except request ``rid`` emits token ``t`` at index ``k`` for
    ``stops[rid] == (k, t)``."""

    def token(rid: str, i: int) -> int:
        if rid in stops and stops[rid][0] == i:
            return stops[rid][1]
        return plain_token(rid, i)

    return token


@dataclass
class Launch:
    """What the fake runner saw of one ScheduledBatch."""

    step: int
    mode: ForwardMode
    rids: list[str]
    prefix_lens: list[int]
    extend_lens: list[int]
    num_decode: int
    sample_rids: list[str]
    tokens: list[int]
    rows: list[int]
    settled: bool = False

    def extend_of(self, rid: str) -> int:
        return self.extend_lens[self.rids.index(rid)]


class _LandingEvent(HostEvent):
    """An unrecorded (complete) host event that tells the fake when the host waited."""

    def __init__(self, launch: Launch) -> None:
        super().__init__()
        self.launch = launch

    def synchronize(self) -> None:
        self.launch.settled = True


@dataclass
class FakeRunner:
    """The scheduler's view of a model runner, on tiny real CPU pools."""

    num_rows: int
    num_pages: int
    page_size: int
    max_context: int
    token: TokenFn = plain_token
    launches: list[Launch] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)
    _prompts: dict[str, list[int]] = field(default_factory=dict)
    _table: dict[tuple[int, int], int] = field(default_factory=dict)  # (row, pos) -> slot
    _kv: dict[int, int] = field(default_factory=dict)  # slot -> token whose KV it holds

    def __post_init__(self) -> None:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.req_pool = ReqToTokenPool(self.num_rows, self.max_context, "cpu")
        self.kv_pool = PagedKVPool(self.num_pages, self.page_size, layout, "cpu")
        self.timeline = self  # the scheduler calls ``runner.timeline.collect()``

    def collect(self) -> None:
        pass

    def take_steps(self) -> list[tuple[object, float]]:
        return []  # no forward is timed here

    def share_masks(self, step: int, bitmask: torch.Tensor) -> None:
        pass  # one rank: nobody to share with

    def register(self, req: Request) -> None:
        self._prompts[req.rid] = list(req.prompt_ids)

    def seq_token(self, rid: str, pos: int) -> int:
        prompt = self._prompts[rid]
        return prompt[pos] if pos < len(prompt) else self.token(rid, pos - len(prompt))

    def discard_rows(self, rows: list[int]) -> None:
        for row in rows:
            users = [b.step for b in self.launches if not b.settled and row in b.rows]
            assert not users, f"row {row} released while batches {users} still use it"
        self.discarded.extend(rows)

    def launch(
        self, batch: ScheduledBatch, sampling: SamplingInputs | None, new_period: bool = False
    ) -> LaunchedBatch:
        for row, col, slot in zip(
            batch.table_rows, batch.table_cols, batch.table_slots, strict=True
        ):
            self._table[(row, col)] = slot
        assert len(set(batch.rows)) == len(batch.rows), "a row twice in one batch"
        cursor, tokens_at = 0, 0
        for i, req in enumerate(batch.reqs):
            rid, row = req.rid, batch.rows[i]
            start, n = batch.prefix_lens[i], batch.extend_lens[i]
            for pos in range(start):  # what attention reads
                got = self._kv.get(self._table.get((row, pos), -1))
                assert got == self.seq_token(rid, pos), f"{rid} reads bad KV at {pos}"
            decode = i >= len(batch.reqs) - batch.num_decode
            if not decode:
                given = batch.prefill_tokens[tokens_at : tokens_at + n]
                want = [self.seq_token(rid, p) for p in range(start, start + n)]
                assert given == want, f"{rid}: prefill tokens {given} != {want}"
                tokens_at += n
            assert n == 1 or not decode
            for k, pos in enumerate(range(start, start + n)):
                slot = batch.out_cache_loc[cursor + k]
                assert self._table[(row, pos)] == slot
                self._kv[slot] = self.seq_token(rid, pos)
            cursor += n
        sample_rids, tokens = [], []
        for k, i in enumerate(batch.sample_indices):
            req = batch.reqs[i]
            index = batch.prefix_lens[i] + batch.extend_lens[i] - len(req.prompt_ids)
            assert sampling is not None
            assert sampling.steps[k] == index, f"{req.rid}: step {sampling.steps[k]} != {index}"
            sample_rids.append(req.rid)
            tokens.append(self.token(req.rid, index))
        record = Launch(
            step=batch.step,
            mode=batch.mode,
            rids=[r.rid for r in batch.reqs],
            prefix_lens=list(batch.prefix_lens),
            extend_lens=list(batch.extend_lens),
            num_decode=batch.num_decode,
            sample_rids=sample_rids,
            tokens=tokens,
            rows=list(batch.rows),
        )
        self.launches.append(record)
        result = StepResult(next_token_ids=torch.tensor(tokens, dtype=torch.int64))
        return LaunchedBatch(batch, Work.completed(result), _LandingEvent(record))

    def batches_of(self, rid: str) -> list[Launch]:
        return [b for b in self.launches if rid in b.rids]


class Harness:
    def __init__(
        self,
        *,
        overlap: bool = True,
        rows: int = 8,
        pages: int = 256,
        page_size: int = 1,
        context_length: int = 256,
        token: TokenFn = plain_token,
        **options: Any,
    ) -> None:
        self.config = EngineConfig.from_options(
            {"disable_overlap_schedule": not overlap, "page_size": page_size, **options}
        )
        self.runner = FakeRunner(rows, pages, page_size, context_length, token)
        self.sched = Scheduler(
            self.config,
            self.runner,  # type: ignore[arg-type]
            eos_ids=[EOS],
            context_length=context_length,
            strict_accounting=True,
        )
        self.reqs: dict[str, Request] = {}
        self.updates: list[Update] = []

    def add(self, rid: str, prompt: list[int] | int, **params: Any) -> Request:
        ids = (
            [10 + (sum(map(ord, rid)) + j) % 50 for j in range(prompt)]
            if isinstance(prompt, int)
            else list(prompt)
        )
        params.setdefault("temperature", 0)
        req = Request(rid, ids, SamplingParams(**params), StopChecker([], None))
        self.runner.register(req)
        self.reqs[rid] = req
        self.sched.add(req)
        return req

    def step(self) -> list[Update]:
        updates = self.sched.iterate()
        self.updates += updates
        admitted = len(self.sched.prefilling) + len(self.sched.running)
        assert admitted + len(self.sched.retiring) <= self.config.max_running_requests
        return updates

    def run(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                break
            self.step()
        self.assert_idle()

    def assert_idle(self) -> None:
        sched = self.sched
        assert not sched.has_work()
        assert not (sched.waiting)
        assert not (sched.prefilling)
        assert not (sched.running)
        assert not sched.retiring
        sched.check_accounting()
        assert self.runner.req_pool.available == self.runner.num_rows
        if self.config.disable_radix_cache:
            assert self.runner.kv_pool.available_pages == self.runner.num_pages - 1
        assert all(b.settled for b in self.runner.launches)
        for rid, req in self.reqs.items():
            assert req.finished, rid
            assert req.row is None
            assert req.pages == []
            streamed = [t for u in self.updates if u.req is req for t in u.new_ids]
            assert streamed == req.output_ids, rid
            ends = [u for u in self.updates if u.req is req and u.finished]
            assert len(ends) == 1, f"{rid} finished {len(ends)} times"
            assert self.updates.index(ends[0]) == max(
                i for i, u in enumerate(self.updates) if u.req is req
            ), f"{rid} got an update after its end"
        c = sched.counters
        assert c.finished_requests == len(self.reqs)
        assert c.generated_tokens == sum(len(r.output_ids) for r in self.reqs.values())

    def expected(self, rid: str, max_new: int, stop_ids: tuple[int, ...] = (EOS,)) -> list[int]:
        out = []
        for i in range(max_new):
            out.append(self.runner.token(rid, i))
            if out[-1] in stop_ids:
                break
        return out

    def samples_of(self, rid: str) -> int:
        return sum(b.sample_rids.count(rid) for b in self.runner.launches)


# -- plain generation, max_new_tokens --------------------------------------------------------------


@LOOPS
def test_length_limit_no_overshoot(overlap: bool) -> None:
    h = Harness(overlap=overlap)
    lens = {"a": 5, "b": 1, "c": 3}
    for rid, n in lens.items():
        h.add(rid, 4 + len(rid), max_new_tokens=n)
    h.run()
    first = h.runner.launches[0]
    assert first.mode is ForwardMode.PREFILL
    assert first.rids == ["a", "b", "c"]
    assert first.sample_rids == ["a", "b", "c"]
    for rid, n in lens.items():
        req = h.reqs[rid]
        assert req.output_ids == h.expected(rid, n)
        assert req.finish is not None
        assert req.finish.kind == "length"
        assert req.finish.length == n
        assert h.samples_of(rid) == n  # never scheduled past a predictable end
    assert h.sched.counters.overshoot_steps == 0
    assert h.sched.counters.prompt_tokens == 5 + 5 + 5
    # decode batches shrink as requests reach their length
    assert [len(b.rids) for b in h.runner.launches[1:]] == [2, 2, 1, 1]


@LOOPS
def test_context_length_bounds_outputs(overlap: bool) -> None:
    h = Harness(overlap=overlap, context_length=10)
    h.add("a", 6, max_new_tokens=100)
    h.run()
    req = h.reqs["a"]
    assert req.output_ids == h.expected("a", 4)
    assert req.finish is not None
    assert (req.finish.kind, req.finish.length) == ("length", 4)
    assert h.sched.counters.overshoot_steps == 0


@LOOPS
@pytest.mark.parametrize("chunk", [-1, 4])
def test_max_new_tokens_zero_prefills_only(overlap: bool, chunk: int) -> None:
    h = Harness(overlap=overlap, chunked_prefill_size=chunk)
    h.add("z", 10, max_new_tokens=0)
    h.add("y", 3, max_new_tokens=2)
    h.run()
    z = h.reqs["z"]
    assert z.output_ids == []
    assert z.finish is not None
    assert (z.finish.kind, z.finish.length) == ("length", 0)
    assert h.samples_of("z") == 0
    assert sum(b.extend_of("z") for b in h.runner.batches_of("z")) == 10
    if chunk == 4:
        assert [b.extend_of("z") for b in h.runner.batches_of("z")] == [4, 4, 2]
    assert h.reqs["y"].output_ids == h.expected("y", 2)
    assert h.sched.counters.prompt_tokens == 13


# -- chunked prefill, prefill budget, admission ----------------------------------------------------


@LOOPS
def test_chunked_prefill_exact_chunks(overlap: bool) -> None:
    h = Harness(overlap=overlap, chunked_prefill_size=8, max_prefill_tokens=16)
    h.add("long", 23, max_new_tokens=3)
    h.add("short", 4, max_new_tokens=3)
    h.run()
    long = h.runner.batches_of("long")
    prefill = [b for b in long if b.mode is ForwardMode.PREFILL]
    assert [b.extend_of("long") for b in prefill] == [8, 8, 7]
    assert [b.prefix_lens[b.rids.index("long")] for b in prefill] == [0, 8, 16]
    assert [b.sample_rids.count("long") for b in prefill] == [0, 0, 1]  # last chunk samples
    assert prefill[0].rids == ["long", "short"]  # the short prompt fits the rest of the budget
    # without mixed chunks the short request waits for the long prompt's chunks to decode
    assert [b.mode for b in h.runner.launches[:3]] == [ForwardMode.PREFILL] * 3
    for b in h.runner.launches:
        assert sum(b.extend_lens) <= 16
        assert all(n <= 8 for n in b.extend_lens)
    for rid in ("long", "short"):
        assert h.reqs[rid].output_ids == h.expected(rid, 3)


@LOOPS
def test_max_prefill_tokens_bounds_batch(overlap: bool) -> None:
    h = Harness(overlap=overlap, chunked_prefill_size=-1, max_prefill_tokens=12)
    for rid in "abcde":
        h.add(rid, 5, max_new_tokens=2)
    h.add("f", 30, max_new_tokens=2)  # longer than the budget: split by it
    h.run()
    prefills = [b for b in h.runner.launches if b.mode is ForwardMode.PREFILL]
    assert [b.rids for b in prefills[:3]] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(sum(b.extend_lens) <= 12 for b in h.runner.launches)
    assert [b.extend_of("f") for b in h.runner.batches_of("f")][:3] == [12, 12, 6]
    for rid in "abcdef":
        assert h.reqs[rid].output_ids == h.expected(rid, 2)


@LOOPS
def test_max_running_requests_bounds_admission(overlap: bool) -> None:
    h = Harness(overlap=overlap, rows=8, max_running_requests=2)
    for rid, n in zip("abcd", (2, 4, 3, 1), strict=True):
        h.add(rid, 3, max_new_tokens=n)
    h.run()  # Harness.step asserts the bound after every iteration
    assert h.runner.launches[0].rids == ["a", "b"]
    assert all(len(b.rids) <= 2 for b in h.runner.launches)
    # c starts only after a has finished and been released
    last_a = max(b.step for b in h.runner.batches_of("a"))
    first_c = min(b.step for b in h.runner.batches_of("c"))
    assert first_c > last_a
    for rid, n in zip("abcd", (2, 4, 3, 1), strict=True):
        assert h.reqs[rid].output_ids == h.expected(rid, n)
    assert len(h.runner.discarded) == 4
    assert set(h.runner.discarded) == {1, 2}  # only two rows were ever used


# -- mixed batches ---------------------------------------------------------------------------------


@LOOPS
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_mixed_chunk_carries_decode_rows(overlap: bool, mixed: bool) -> None:
    h = Harness(
        overlap=overlap, chunked_prefill_size=8, max_prefill_tokens=8, enable_mixed_chunk=mixed
    )
    h.add("dec", 4, max_new_tokens=6)
    h.add("long", 24, max_new_tokens=2)
    h.run()
    chunks = [b for b in h.runner.batches_of("long") if b.extend_of("long") > 1]
    assert [b.extend_of("long") for b in chunks] == [8, 8, 8]
    if mixed:
        assert [b.mode for b in chunks] == [ForwardMode.MIXED] * 3
        assert all(b.rids == ["long", "dec"] and b.num_decode == 1 for b in chunks)
        assert all(b.extend_lens == [8, 1] for b in chunks)
        assert h.sched.counters.mixed_steps == 3
        # dec sampled once per chunk batch: its outputs advance during the chunks
        assert all("dec" in b.sample_rids for b in chunks)
    else:
        assert [b.mode for b in chunks] == [ForwardMode.PREFILL] * 3
        assert all(b.num_decode == 0 and b.rids == ["long"] for b in chunks)
        assert h.sched.counters.mixed_steps == 0
    assert any(b.mode is ForwardMode.MIXED for b in h.runner.launches) == mixed
    assert h.reqs["dec"].output_ids == h.expected("dec", 6)
    assert h.reqs["long"].output_ids == h.expected("long", 2)


# -- stops and overshoot ---------------------------------------------------------------------------


@LOOPS
@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_stop_token_overshoot_discarded(overlap: bool, how: str) -> None:
    token = EOS if how == "eos" else STOP
    h = Harness(overlap=overlap, token=stopping_at({"s": (2, token)}))
    extra = {"stop_token_ids": [STOP]} if how == "stop_token_ids" else {}
    h.add("s", 4, max_new_tokens=10, **extra)
    h.add("o", 5, max_new_tokens=6)
    h.run()
    s = h.reqs["s"]
    assert s.output_ids == [plain_token("s", 0), plain_token("s", 1), token]
    assert s.finish is not None
    assert (s.finish.kind, s.finish.matched) == ("stop", token)
    # overlap: one decode step was launched before the host saw the stop; it is discarded
    assert h.samples_of("s") == 3 + overlap
    assert h.sched.counters.overshoot_steps == int(overlap)
    assert h.reqs["o"].output_ids == h.expected("o", 6)
    assert h.sched.counters.generated_tokens == 3 + 6


@LOOPS
def test_ignore_eos_keeps_generating(overlap: bool) -> None:
    h = Harness(overlap=overlap, token=stopping_at({"s": (1, EOS)}))
    h.add("s", 4, max_new_tokens=4, ignore_eos=True)
    h.run()
    s = h.reqs["s"]
    assert s.output_ids == [plain_token("s", 0), EOS, plain_token("s", 2), plain_token("s", 3)]
    assert s.finish is not None
    assert s.finish.kind == "length"
    assert h.sched.counters.overshoot_steps == 0


@LOOPS
def test_stop_on_first_token_from_prefill(overlap: bool) -> None:
    h = Harness(overlap=overlap, token=stopping_at({"s": (0, EOS)}))
    h.add("s", 6, max_new_tokens=5)
    h.run()
    assert h.reqs["s"].output_ids == [EOS]
    assert h.samples_of("s") == 1 + overlap
    assert h.sched.counters.overshoot_steps == int(overlap)


# -- abort -----------------------------------------------------------------------------------------


def _assert_aborted(h: Harness, rid: str) -> None:
    req = h.reqs[rid]
    assert req.finish is not None
    assert req.finish.kind == "abort"
    assert h.sched.abort(rid) is False  # already ended


@LOOPS
def test_abort_while_waiting(overlap: bool) -> None:
    h = Harness(overlap=overlap, max_running_requests=1)
    h.add("a", 4, max_new_tokens=3)
    h.add("w", 4, max_new_tokens=3)
    h.step()
    assert [r.rid for r in h.sched.waiting] == ["w"]
    assert h.sched.abort("w") is True
    assert not h.sched.waiting
    assert h.sched.abort("nobody") is False
    h.run()
    _assert_aborted(h, "w")
    assert h.runner.batches_of("w") == []
    assert h.reqs["w"].output_ids == []
    assert h.reqs["a"].output_ids == h.expected("a", 3)
    assert h.sched.counters.aborted_requests == 1


@LOOPS
def test_abort_while_prefilling(overlap: bool) -> None:
    h = Harness(overlap=overlap, chunked_prefill_size=4)
    h.add("p", 20, max_new_tokens=3)
    h.add("q", 3, max_new_tokens=2)
    h.step()
    h.step()
    assert [r.rid for r in h.sched.prefilling] == ["p"]
    assert h.sched.abort("p") is True
    launched = len(h.runner.batches_of("p"))
    h.run()
    _assert_aborted(h, "p")
    assert len(h.runner.batches_of("p")) == launched == 2
    assert h.reqs["p"].output_ids == []
    assert h.reqs["q"].output_ids == h.expected("q", 2)


@LOOPS
def test_abort_while_decoding(overlap: bool) -> None:
    h = Harness(overlap=overlap)
    h.add("d", 4, max_new_tokens=50)
    h.add("e", 4, max_new_tokens=6)
    for _ in range(4):
        h.step()
    d = h.reqs["d"]
    assert d in h.sched.running
    assert h.sched.abort("d") is True
    kept = list(d.output_ids)
    assert kept == h.expected("d", len(kept))
    launched = len(h.runner.batches_of("d"))
    h.run()
    _assert_aborted(h, "d")
    assert d.output_ids == kept  # nothing appended after the abort
    assert len(h.runner.batches_of("d")) == launched  # nothing launched after it
    # overlap: the decode in flight at the abort is discarded (counted as overshoot)
    assert h.sched.counters.overshoot_steps == int(overlap)
    assert h.reqs["e"].output_ids == h.expected("e", 6)


def test_abort_in_flight_first_prefill() -> None:
    """Overlap loop: abort right after the request's only batch was launched and before
    it was processed; its row is released only after that batch settles."""
    h = Harness(overlap=True)
    h.add("f", 5, max_new_tokens=4)
    h.step()
    [launch] = h.runner.launches
    assert not launch.settled
    assert h.reqs["f"].in_flight == 1
    assert h.sched.abort("f") is True
    assert h.reqs["f"].row is not None  # still used by the batch in flight
    updates = h.step()
    assert launch.settled
    assert [(u.req.rid, u.new_ids, u.finished) for u in updates] == [("f", [], True)]
    h.run()
    _assert_aborted(h, "f")
    assert h.reqs["f"].output_ids == []  # the token of the settled batch is dropped
    assert h.runner.discarded == [1]


# -- retraction ------------------------------------------------------------------------------------


def _run_watching_requeues(h: Harness) -> list[tuple[str, int]]:
    """Run to idle; each retracted request seen in ``waiting``, with its output count."""
    requeued: list[tuple[str, int]] = []
    for _ in range(300):
        if not h.sched.has_work():
            break
        h.step()
        for req in h.sched.waiting:
            if req.output_ids and (req.rid, len(req.output_ids)) not in requeued:
                requeued.append((req.rid, len(req.output_ids)))
    h.assert_idle()
    return requeued


@LOOPS
@pytest.mark.parametrize("radix", [False, True], ids=["noradix", "radix"])
def test_retraction_requeues_newest(overlap: bool, radix: bool) -> None:
    # 3 requests of 4 + 8 tokens need 36 KV slots; the pool has 24 (page 0 is padding).
    h = Harness(overlap=overlap, pages=25, disable_radix_cache=not radix)
    for rid in "abc":
        h.add(rid, 4, max_new_tokens=8)
    requeued = _run_watching_requeues(h)
    c = h.sched.counters
    assert c.retracted_requests >= 1
    assert requeued
    assert requeued[0][0] == "c"
    for rid in "abc":
        assert h.reqs[rid].output_ids == h.expected(rid, 8)
        assert h.samples_of(rid) == 8
    # the retracted request re-prefills its prompt and the outputs it had
    c_prefills = [b for b in h.runner.batches_of("c") if b.num_decode == 0]
    assert len(c_prefills) >= 2
    back = c_prefills[1]
    refill = back.prefix_lens[back.rids.index("c")] + back.extend_of("c")
    assert refill == 4 + requeued[0][1]
    assert c.prompt_tokens == 12  # not counted again
    assert c.cached_tokens == 0
    assert h.reqs["c"].cached_tokens == 0
    assert c.overshoot_steps == 0


@LOOPS
def test_retracted_requests_keep_their_order(overlap: bool) -> None:
    # 4 requests: the two newest are retracted (d, then c); both go to the front of the
    # queue and come back in admission order, in one prefill batch.
    h = Harness(overlap=overlap, pages=25, disable_radix_cache=True)
    for rid in "abcd":
        h.add(rid, 4, max_new_tokens=8)
    waits: list[list[str]] = []
    for _ in range(300):
        if not h.sched.has_work():
            break
        h.step()
        waits.append([r.rid for r in h.sched.waiting])
    h.assert_idle()
    assert h.sched.counters.retracted_requests == 2
    assert ["c", "d"] in waits
    assert ["d", "c"] not in waits
    [back] = [b for b in h.runner.launches if b.step > 1 and b.mode is ForwardMode.PREFILL]
    assert back.rids == ["c", "d"]
    assert back.extend_lens == [4 + 5, 4 + 3]  # prompt + the outputs each had
    for rid in "abcd":
        assert h.reqs[rid].output_ids == h.expected(rid, 8)


@LOOPS
def test_retracted_request_reuses_its_cached_kv(overlap: bool) -> None:
    # With the radix cache a retracted request's computed KV is cached when it is freed,
    # so its re-prefill starts from there; cached_tokens still reports only the prefix
    # found at its first admission.
    h = Harness(overlap=overlap, pages=29, max_running_requests=3)
    for rid in "abcd":
        h.add(rid, 4, max_new_tokens=8)
    requeued = _run_watching_requeues(h)
    assert [rid for rid, _ in requeued] == ["c"]
    c_prefills = [b for b in h.runner.batches_of("c") if b.num_decode == 0]
    assert len(c_prefills) == 2
    back = c_prefills[1]
    prefix = back.prefix_lens[back.rids.index("c")]
    assert 0 < prefix < 4 + requeued[0][1]
    assert prefix + back.extend_of("c") == 4 + requeued[0][1]
    assert h.reqs["c"].cached_tokens == 0
    assert h.sched.counters.cached_tokens == 0
    for rid in "abcd":
        assert h.reqs[rid].output_ids == h.expected(rid, 8)


@LOOPS
def test_abort_after_retraction(overlap: bool) -> None:
    """A retracted request is back in ``waiting`` with the outputs it had; aborting it
    there keeps them and it is never prefilled again."""
    h = Harness(overlap=overlap, pages=25, disable_radix_cache=True)
    for rid in "abc":
        h.add(rid, 4, max_new_tokens=8)
    for _ in range(50):
        h.step()
        if h.sched.waiting:
            break
    [victim] = h.sched.waiting
    assert victim.rid == "c"
    assert victim.output_ids
    assert victim.row is None
    assert h.sched.counters.retracted_requests == 1
    kept = list(victim.output_ids)
    launched = len(h.runner.batches_of("c"))
    assert h.sched.abort("c") is True
    h.run()
    _assert_aborted(h, "c")
    assert victim.output_ids == kept == h.expected("c", len(kept))
    assert len(h.runner.batches_of("c")) == launched
    for rid in "ab":
        assert h.reqs[rid].output_ids == h.expected(rid, 8)


# -- radix cache -----------------------------------------------------------------------------------


@LOOPS
@pytest.mark.parametrize("radix", [False, True], ids=["noradix", "radix"])
def test_radix_prefix_reuse(overlap: bool, radix: bool) -> None:
    h = Harness(overlap=overlap, page_size=4, pages=64, disable_radix_cache=not radix)
    base = list(range(20, 32))  # 12 tokens, 3 pages
    h.add("a", base, max_new_tokens=3)
    h.run()
    out = h.reqs["a"].output_ids  # KV cached: prompt + 2 outputs (the last has no KV)
    h.add("b", [*base[:9], 90, 91], max_new_tokens=2)  # shares 2 whole pages
    h.add("same", list(base), max_new_tokens=2)  # one token must still be computed
    h.add("cont", [*base, *out[:2], 95], max_new_tokens=2)  # continues a's conversation
    h.run()
    want = {"b": 8, "same": 8, "cont": 12} if radix else {"b": 0, "same": 0, "cont": 0}
    for rid, cached in want.items():
        req = h.reqs[rid]
        assert req.cached_tokens == cached, rid
        [first] = [b for b in h.runner.batches_of(rid) if b.mode is ForwardMode.PREFILL]
        assert first.prefix_lens[first.rids.index(rid)] == cached
        assert first.extend_of(rid) == len(req.prompt_ids) - cached
        assert req.output_ids == h.expected(rid, 2)
    assert h.sched.counters.cached_tokens == sum(want.values())


def test_radix_eviction_under_pressure() -> None:
    # 10 usable pages of 2 tokens; cached pages must be evicted for later prompts.
    h = Harness(page_size=2, pages=11)
    for i in range(6):
        h.add(f"r{i}", [40 + i] * 8, max_new_tokens=3)
        h.run()
        assert h.reqs[f"r{i}"].output_ids == h.expected(f"r{i}", 3)
    h.add("again", [45] * 8, max_new_tokens=2)  # the newest prefix survived eviction
    h.run()
    assert h.reqs["again"].cached_tokens == 6


# -- everything at once ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(16))
def test_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    overlap, mixed = bool(seed % 2), seed % 3 == 0
    stops = {f"r{i}": (rng.randrange(24), rng.choice((EOS, STOP))) for i in range(14)}
    page_size = rng.choice((1, 2, 4))
    h = Harness(
        overlap=overlap,
        token=stopping_at(stops),
        page_size=page_size,
        pages=1 + rng.randrange(40, 72) // page_size,  # tight: retractions happen
        rows=6,
        max_running_requests=6,
        chunked_prefill_size=rng.choice((-1, 5, 8)),
        max_prefill_tokens=rng.choice((12, 32)),
        enable_mixed_chunk=mixed,
        disable_radix_cache=seed % 4 == 1,
    )
    shared = [rng.randrange(10, 60) for _ in range(10)]
    aborted: set[str] = set()
    pending = list(range(14))
    steps = 0
    while pending or h.sched.has_work():
        if pending and rng.random() < 0.4:
            i = pending.pop(0)
            prompt = shared[: rng.randrange(11)] + [rng.randrange(10, 60) for _ in range(3)]
            h.add(f"r{i}", prompt, max_new_tokens=rng.randrange(20), stop_token_ids=[STOP])
        if h.reqs and rng.random() < 0.08:
            rid = rng.choice(sorted(h.reqs))
            if not h.reqs[rid].finished and h.sched.abort(rid):
                aborted.add(rid)
        h.step()
        steps += 1
        assert steps < 1000
    h.assert_idle()
    for rid, req in h.reqs.items():
        want = h.expected(rid, req.params.max_new_tokens, (EOS, STOP))
        assert req.finish is not None
        if rid in aborted:
            assert req.finish.kind == "abort"
            assert req.output_ids == want[: len(req.output_ids)]
        else:
            assert req.output_ids == want, rid
            kind = "stop" if want and want[-1] in (EOS, STOP) else "length"
            assert req.finish.kind == kind
    assert h.sched.counters.aborted_requests == len(aborted)
    if not overlap:
        assert h.sched.counters.overshoot_steps == 0
