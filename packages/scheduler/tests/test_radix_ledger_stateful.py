"""The radix cache, the KV pool and the page ledger driven together, the way the scheduler
drives them, in random interleavings, against a plain-Python model.

A request is admitted (match a prefix capped at ``len - 1``, lock it, ``ledger.hold`` the
matched pages, reserve its first chunk, evicting ahead when the pool is short), has
batches launched that write its private pages (``ledger.launch``) and settled
(``ledger.settle``), and finishes (``ledger.adopt`` + ``insert`` of the whole pages of some
computed prefix, ``ledger.free`` of the rest, ``ledger.unhold`` + ``unlock``). Plain
matches, bare locks, evictions, idle drains and resets come in between, and so do
forbidden hand-overs, which the ledger must refuse without changing its state.

The model is a dict from each cached page-aligned token prefix to the page holding that
prefix's last page, plus a shadow array giving every page the content it holds: the
tokens up to the last position written there. The property that protects output is that
a match returns only pages whose content is exactly the matched tokens' prefixes; the
rest (every page in exactly one place, locked pages kept, the ledger agreeing with pool
and cache, nothing leaked at idle) is the bookkeeping that makes it hold.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.scheduler.kv.page_ledger import CACHE, PageLedger, PageOwnershipError
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool
from tandem.scheduler.kv.radix_cache import PrefixMatch, RadixCache, RadixNode
from tandem.scheduler.request import Request
from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.text.stop import StopChecker

Prefix = tuple[int, ...]
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
TOKEN = st.integers(0, 3)  # a tiny vocabulary, so prefixes (and pages) collide often
MAX_PAGES = 5  # longest request, in pages
MAX_LIVE = 6  # live requests at once
HISTORY = 16  # recent token sequences new ones may share a prefix with
T = TypeVar("T")


def make_request(rid: str, tokens: list[int]) -> Request:
    """A request whose whole sequence (prompt and the outputs it will produce) is
    ``tokens``: the ledger only cares about its identity."""
    return Request(rid, list(tokens), SamplingParams(), StopChecker([], None))


@st.composite
def token_seqs(draw: st.DrawFn, ps: int, history: list[list[int]]) -> list[int]:
    """A fresh sequence, or one sharing a prefix of a recent one and diverging anywhere
    (inside a page, too)."""
    if not history or draw(st.integers(0, 3)) == 0:
        return draw(st.lists(TOKEN, min_size=1, max_size=MAX_PAGES * ps))
    base = draw(st.sampled_from(history))
    cut = draw(st.integers(0, len(base)))
    if draw(st.booleans()):
        cut -= cut % ps  # diverge at a page boundary, or inside a page
    tail = draw(st.lists(TOKEN, max_size=2 * ps + 1))
    tokens = (base[:cut] + tail)[: MAX_PAGES * ps]
    return tokens or [0]


def ledger_state(ledger: PageLedger) -> tuple[object, object, object]:
    """A copy of the ledger's whole state, to show a refused move changed nothing."""
    return (
        dict(ledger._owner),
        {page: set(holders) for page, holders in ledger._holders.items()},
        {req: list(batches) for req, batches in ledger._in_flight.items()},
    )


class RadixLedgerMachine(RuleBasedStateMachine):
    """See the module docstring. ``Request.pages`` holds the matched (cached) pages first,
    ``shared_pages`` of them, then the request's private pages, as in the scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self._setup(page_size=1, num_pages=16)

    def _setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.num_pages = num_pages
        self.pool = PagedKVPool(num_pages, page_size, LAYOUT, "cpu")
        self.ledger = PageLedger(num_pages)
        self.radix = RadixCache(page_size, self._cache_frees)
        self.cached: dict[Prefix, int] = {}  # the model: cached prefix -> its last page
        self.content: list[Prefix | None] = [None] * num_pages  # what each page holds
        self.live: list[Request] = []
        self.handles: list[tuple[RadixNode, Prefix]] = []  # bare locks, no request
        self.batches: deque[tuple[int, list[Request]]] = deque()  # launched, not settled
        self.steps = 0
        self.rids = itertools.count()
        self.history: list[list[int]] = []
        self.duplicates: list[int] | None = None  # what an insert in progress must free
        self.freed: list[int] = []  # what the cache freed during the last operation

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(12, 40))
    def configure(self, page_size: int, num_pages: int) -> None:
        self._setup(page_size, num_pages)

    # ------------------------------------------------------------------ the model

    def _prefixes(self, tokens: list[int], num_pages: int) -> list[Prefix]:
        return [tuple(tokens[: k * self.ps]) for k in range(1, num_pages + 1)]

    def _model_match(self, tokens: list[int], cap: int | None) -> list[int]:
        limit = len(tokens) if cap is None else min(len(tokens), cap)
        pages = []
        for prefix in self._prefixes(tokens, limit // self.ps):
            if prefix not in self.cached:
                break
            pages.append(self.cached[prefix])
        return pages

    def _locks(self) -> list[Prefix]:
        own = [tuple(r.prompt_ids[: r.shared_pages * self.ps]) for r in self.live]
        return own + [prefix for _, prefix in self.handles]

    def _is_locked(self, prefix: Prefix) -> bool:
        return any(held[: len(prefix)] == prefix for held in self._locks())

    def _private(self, req: Request) -> list[int]:
        return req.pages[req.shared_pages :]

    def _expected_content(self, req: Request, index: int) -> Prefix | None:
        """What ``req``'s page ``index`` holds: the tokens up to the last position of
        that page written so far, or nothing if none was."""
        start = index * self.ps
        if req.kv_len <= start:
            return None
        return tuple(req.prompt_ids[: min(req.kv_len, start + self.ps)])

    # ------------------------------------------------------------------ the protocol

    def _cache_frees(self, pages: list[int]) -> None:
        """The cache's ``free_pages`` callback, as the scheduler wires it (ledger, then
        pool), after checking the model agrees that these pages may go."""
        pages = list(pages)
        if self.duplicates is not None:  # an insert drops the caller's duplicates
            assert pages == self.duplicates, f"insert freed {pages}, not {self.duplicates}"
        else:  # eviction or reset
            where = {page: prefix for prefix, page in self.cached.items()}
            for page in pages:
                assert page in where, f"the cache frees page {page}, which it does not hold"
                prefix = where[page]
                assert not self._is_locked(prefix), (
                    f"the cache frees page {page} of the locked prefix {prefix}"
                )
                del self.cached[prefix]
        self.ledger.cache_frees(pages)
        self.pool.free_pages(pages)
        for page in pages:
            self.content[page] = None
        self.freed.extend(pages)

    def _match(self, tokens: list[int], cap: int | None) -> PrefixMatch:
        expected = self._model_match(tokens, cap)
        assert self.radix.prefix_length(tokens, cap) == len(expected) * self.ps
        match = self.radix.match_prefix(tokens, cap)
        for prefix, page in zip(self._prefixes(tokens, len(match.pages)), match.pages, strict=True):
            assert self.content[page] == prefix, (
                f"matched page {page} for {prefix}, but it holds {self.content[page]}"
            )
        assert match.pages == expected
        assert match.num_tokens == len(expected) * self.ps
        return match

    def _evict(self, num_pages: int) -> None:
        evictable = self.radix.evictable_pages
        self.freed = []
        got = self.radix.evict(num_pages)
        assert got == min(num_pages, evictable) == len(self.freed)

    def _alloc(self, count: int, extra: int) -> list[int] | None:
        """``Resources.reserve``: evict ahead (at least ``extra``) when short."""
        if count <= 0:
            return []
        short = count - self.pool.available_pages
        if short > 0:
            self._evict(max(short, extra))
        pages = self.pool.alloc_pages(count)
        for page in pages or ():
            assert self.content[page] is None, f"free page {page} holds {self.content[page]}"
        return pages

    def _reserve(self, req: Request, end: int, extra: int) -> bool:
        """``Resources.reserve``: pages for every position below ``end``."""
        need = self.pool.pages_for(end) - len(req.pages)
        if need <= 0:
            return True
        pages = self._alloc(need, extra)
        if pages is None:
            return False
        self.ledger.take(req, pages)
        req.pages.extend(pages)
        return True

    def _finish(self, req: Request, length: int) -> None:
        """``Resources.free`` with ``kv_len == length``: the cache gets the whole pages
        of the first ``length`` tokens, the request frees the rest and its lock."""
        assert req.in_flight == 0
        tokens = req.prompt_ids[:length]
        whole = length // self.ps
        given = req.pages[:whole]
        duplicates, adopted = [], []
        for prefix, page in zip(self._prefixes(tokens, whole), given, strict=True):
            assert self.content[page] == prefix
            if prefix not in self.cached:
                adopted.append((prefix, page))
            elif self.cached[prefix] != page:
                duplicates.append(page)
        self.ledger.adopt(req, given)
        self.freed, self.duplicates = [], duplicates
        try:
            assert self.radix.insert(tokens, given) == len(adopted)
        finally:
            self.duplicates = None
        assert self.freed == duplicates, f"insert freed {self.freed}, not {duplicates}"
        self.cached.update(adopted)
        rest = req.pages[whole:]
        self.ledger.free(req, rest)
        self.pool.free_pages(rest)
        for page in rest:
            self.content[page] = None
        self.ledger.unhold(req, req.pages[: req.shared_pages])
        self.live.remove(req)  # its lock leaves the model with it
        self.radix.unlock(req.prefix_node)
        req.pages, req.shared_pages, req.prefix_node = [], 0, None

    def _land_oldest(self) -> None:
        step, reqs = self.batches.popleft()
        self.ledger.settle(step, reqs)
        for req in reqs:
            req.in_flight -= 1

    def _drain(self) -> None:
        """Land every batch, finish every request, drop every bare lock: the scheduler
        at idle, where the ledger's idle check must pass."""
        while self.batches:
            self._land_oldest()
        while self.live:
            self._finish(self.live[0], self.live[0].kv_len)
        while self.handles:
            node, _ = self.handles.pop()
            self.radix.unlock(node)
        self.ledger.check_idle(self.pool.free_page_list(), self.radix.held_pages())
        assert self.radix.evictable_pages == self.radix.cached_pages

    def _tokens(self, data: st.DataObject) -> list[int]:
        return data.draw(token_seqs(self.ps, list(self.history)), label="tokens")

    def _remember(self, tokens: list[int]) -> None:
        self.history = [*self.history, tokens][-HISTORY:]

    # ------------------------------------------------------------------ rules: the protocol

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """``Resources.admit``, then the prefill batch with its first chunk (whose
        pages must be there: they were counted as available)."""
        tokens = self._tokens(data)
        chunk = data.draw(st.integers(1, 3 * self.ps), label="chunk")
        extra = data.draw(st.integers(0, 4), label="evict ahead")
        self._remember(tokens)
        match = self._match(tokens, len(tokens) - 1)
        self.radix.lock(match.node)
        cached = match.num_tokens
        first = min(len(tokens) - cached, chunk)
        need = self.pool.pages_for(cached + first) - len(match.pages)
        if need > self.pool.available_pages + self.radix.evictable_pages:
            self.radix.unlock(match.node)
            return
        req = make_request(f"r{next(self.rids)}", tokens)
        req.prefix_node = match.node
        req.pages = list(match.pages)
        req.shared_pages = len(match.pages)
        req.kv_len = cached
        self.ledger.hold(req, match.pages)
        self.live.append(req)
        assert self._launch([(req, first)], extra), "admitted, yet no KV for its first chunk"

    @precondition(lambda self: any(r.kv_len < len(r.prompt_ids) for r in self.live))
    @rule(data=st.data())
    def launch(self, data: st.DataObject) -> None:
        """A batch (prefill chunks, decode steps) writing the next positions of some
        requests, reserving pages for them first; one that gets none sits it out."""
        open_reqs = [r for r in self.live if r.kv_len < len(r.prompt_ids)]
        picks = data.draw(
            st.lists(st.integers(0, len(open_reqs) - 1), min_size=1, unique=True), label="reqs"
        )
        extra = data.draw(st.integers(0, 4), label="evict ahead")
        chunks = []
        for req in (open_reqs[i] for i in picks):
            left = len(req.prompt_ids) - req.kv_len
            chunks.append((req, data.draw(st.integers(1, min(left, 2 * self.ps + 1)), label="n")))
        self._launch(chunks, extra)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def run_to_end(self, data: st.DataObject) -> None:
        """Settle what a request has in flight, write the rest of it in one batch, settle
        that, and (usually) finish it: whole sequences reach the cache."""
        req = self.live[data.draw(st.integers(0, len(self.live) - 1), label="req")]
        while req.in_flight:
            self._land_oldest()
        left = len(req.prompt_ids) - req.kv_len
        if left and self._launch([(req, left)], data.draw(st.integers(0, 4), label="extra")):
            while req.in_flight:
                self._land_oldest()
        if data.draw(st.booleans(), label="finish"):
            self._finish(req, req.kv_len)

    def _launch(self, chunks: list[tuple[Request, int]], extra: int) -> bool:
        """``Scheduler._launch``: reserve each request's chunk, then launch one batch
        writing them; return whether anything was launched."""
        writes: list[tuple[Request, int, int]] = []
        for req, n in chunks:
            if self._reserve(req, req.kv_len + n, extra):
                writes.append((req, req.kv_len, n))
        if not writes:
            return False
        self.steps += 1
        self.ledger.launch(
            self.steps,
            [
                (req, {req.pages[p // self.ps] for p in range(start, start + n)})
                for req, start, n in writes
            ],
        )
        for req, start, n in writes:
            for p in range(start, start + n):
                assert p // self.ps >= req.shared_pages, "a write into a shared page"
                page = req.pages[p // self.ps]
                before = tuple(req.prompt_ids[:p]) if p % self.ps else None
                assert self.content[page] == before
                self.content[page] = tuple(req.prompt_ids[: p + 1])
            req.kv_len = start + n
            req.in_flight += 1
        self.batches.append((self.steps, [req for req, _, _ in writes]))
        return True

    @precondition(lambda self: bool(self.batches))
    @rule()
    def settle(self) -> None:
        self._land_oldest()

    @precondition(lambda self: any(r.in_flight == 0 for r in self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finish (or abort, or retract) a request with nothing in flight; usually all it
        computed goes to the cache, sometimes less (a speculative step's rejected tail)."""
        idle = [r for r in self.live if r.in_flight == 0]
        req = idle[data.draw(st.integers(0, len(idle) - 1), label="req")]
        low = req.shared_pages * self.ps
        length = data.draw(st.just(req.kv_len) | st.integers(low, req.kv_len), label="length")
        self._finish(req, length)

    # ------------------------------------------------------------------ rules: the cache alone

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data: st.DataObject, lock: bool) -> None:
        """A plain match (a queue ordering's ``prefix_length``, a match whose request
        is not admitted), sometimes locked without a request: a bare lock."""
        tokens = self._tokens(data)
        cap = data.draw(st.none() | st.integers(0, len(tokens) + 2), label="cap")
        match = self._match(tokens, cap)
        if lock:
            self.radix.lock(match.node)
            self.handles.append((match.node, tuple(tokens[: match.num_tokens])))

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def unlock_a_match(self, data: st.DataObject) -> None:
        node, _ = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.radix.unlock(node)

    @rule(num_pages=st.integers(0, 3))
    def evict(self, num_pages: int) -> None:
        self._evict(num_pages)

    @rule(idle=st.integers(0, 4), reset=st.integers(0, 3))
    def drain_to_idle(self, idle: int, reset: int) -> None:
        """Now and then the scheduler runs dry: every page is free or cached, which
        the ledger checks against the pool and the cache; sometimes the cache is then
        reset."""
        if idle < 4:
            return
        self._drain()
        if reset == 3:
            self.freed = []
            self.radix.reset()
            assert not self.cached
            assert sorted(self.pool.free_page_list()) == list(range(1, self.num_pages))
            self.ledger.check_idle(self.pool.free_page_list(), self.radix.held_pages())

    # ------------------------------------------------------------------ rules: forbidden moves

    def _forbidden_moves(self) -> dict[str, Callable[[st.DataObject], Callable[[], None]]]:
        """Each forbidden move applicable now: a function drawing its details and
        returning the ledger call that must be refused."""
        ledger, live, cached = self.ledger, self.live, sorted(self.cached.values())
        free = sorted(self.pool.free_page_list())
        private = {page: r for r in live for page in self._private(r)}
        owners = [r for r in live if self._private(r)]
        holding = [r for r in live if r.shared_pages]
        busy = [r for r in owners if r.in_flight]
        pages = range(1, self.num_pages)

        def pick(data: st.DataObject, items: Sequence[T], label: str) -> T:
            return items[data.draw(st.integers(0, len(items) - 1), label=label)]

        def free_foreign(data: st.DataObject) -> Callable[[], None]:
            page = pick(data, sorted(private), "page")
            thief = pick(data, [r for r in live if r is not private[page]], "thief")
            return lambda: ledger.free(thief, [page])

        def free_unowned(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, live, "req")
            page = pick(data, free + cached, "free or cached page")
            return lambda: ledger.free(req, [page])

        def adopt_unheld(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, [r for r in live if len(cached) > r.shared_pages], "req")
            held = req.pages[: req.shared_pages]
            page = pick(data, [p for p in cached if p not in held], "page")
            return lambda: ledger.adopt(req, [page])

        def adopt_foreign(data: st.DataObject) -> Callable[[], None]:
            page = pick(data, sorted(private), "page")
            thief = pick(data, [r for r in live if r is not private[page]], "thief")
            return lambda: ledger.adopt(thief, [page])

        def free_in_flight(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, busy, "req")
            page = pick(data, self._private(req), "page")
            if data.draw(st.booleans(), label="adopt rather than free"):
                return lambda: ledger.adopt(req, [page])
            return lambda: ledger.free(req, [page])

        def cache_frees_held(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, holding, "req")
            page = pick(data, req.pages[: req.shared_pages], "page")
            return lambda: ledger.cache_frees([page])

        def cache_frees_unowned(data: st.DataObject) -> Callable[[], None]:
            page = pick(data, sorted(private) + free, "private or free page")
            return lambda: ledger.cache_frees([page])

        def write_not_private(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, live, "req")
            mine = self._private(req)
            page = pick(data, [p for p in pages if p not in mine], "page")
            return lambda: ledger.launch(self.steps + 1, [(req, {page})])

        def take_taken(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, live, "req")
            taken = [p for p in range(self.num_pages + 1) if p not in free]  # 0, n: no pages
            page = pick(data, taken, "page")
            return lambda: ledger.take(req, [page])

        def hold_uncached(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, live, "req")
            page = pick(data, free + sorted(private), "page")
            return lambda: ledger.hold(req, [page])

        def unhold_unheld(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, live, "req")
            held = req.pages[: req.shared_pages]
            page = pick(data, [p for p in pages if p not in held], "page")
            return lambda: ledger.unhold(req, [page])

        def land_unknown(data: st.DataObject) -> Callable[[], None]:
            req = pick(data, live, "req")
            mine = {step for step, reqs in self.batches if any(r is req for r in reqs)}
            step = pick(data, [s for s in range(self.steps + 2) if s not in mine], "step")
            return lambda: ledger.settle(step, [req])

        applicable = {
            "free another request's page": private and len(live) >= 2,
            "free a free or cached page": live and (free or cached),
            "adopt a cached page it does not hold": any(len(cached) > r.shared_pages for r in live),
            "adopt another request's page": private and len(live) >= 2,
            "free or adopt while in flight": busy,
            "the cache frees a held page": holding,
            "the cache frees a page it does not own": private or free,
            "write a page not private to the request": live,
            "take a page that is not free": live,
            "hold a page the cache does not own": live and (private or free),
            "unhold a page never held": live,
            "settle a batch not in flight": live,
        }
        drawers = {
            "free another request's page": free_foreign,
            "free a free or cached page": free_unowned,
            "adopt a cached page it does not hold": adopt_unheld,
            "adopt another request's page": adopt_foreign,
            "free or adopt while in flight": free_in_flight,
            "the cache frees a held page": cache_frees_held,
            "the cache frees a page it does not own": cache_frees_unowned,
            "write a page not private to the request": write_not_private,
            "take a page that is not free": take_taken,
            "hold a page the cache does not own": hold_uncached,
            "unhold a page never held": unhold_unheld,
            "settle a batch not in flight": land_unknown,
        }
        return {name: drawers[name] for name, ok in applicable.items() if ok}

    @rule(data=st.data())
    def forbidden_move(self, data: st.DataObject) -> None:
        moves = self._forbidden_moves()
        if not moves:
            return
        name = data.draw(st.sampled_from(sorted(moves)), label="forbidden move")
        call = moves[name](data)
        before = ledger_state(self.ledger)
        with pytest.raises(PageOwnershipError):
            call()
        assert ledger_state(self.ledger) == before, f"refusing {name!r} changed the ledger"

    # ------------------------------------------------------------------ invariants

    @invariant()
    def radix_consistent(self) -> None:
        self.radix.check()

    @invariant()
    def every_page_in_one_place(self) -> None:
        free = self.pool.free_page_list()
        held = self.radix.held_pages()
        private = [page for r in self.live for page in self._private(r)]
        assert sorted(free + sorted(held) + private) == list(range(1, self.num_pages))
        assert held == set(self.cached.values())
        assert self.radix.cached_pages == len(held) == len(self.cached)
        assert self.radix.cached_pages + self.pool.available_pages + len(private) == (
            self.num_pages - 1
        )

    @invariant()
    def locks_and_evictable(self) -> None:
        locked = sum(1 for prefix in self.cached if self._is_locked(prefix))
        assert self.radix.evictable_pages == len(self.cached) - locked
        assert self.radix.evictable_pages + locked == self.radix.cached_pages

    @invariant()
    def contents(self) -> None:
        """The cache is prefix-closed and each cached page holds its prefix; free pages
        hold nothing; a live request's matched pages are still the cache's pages for its
        prefix (a lock keeps them), and its private pages hold what it wrote."""
        for prefix, page in self.cached.items():
            assert len(prefix) == self.ps or prefix[: -self.ps] in self.cached
            assert self.content[page] == prefix, f"page {page} cached for {prefix}"
        for page in self.pool.free_page_list():
            assert self.content[page] is None
        for req in self.live:
            prefixes = self._prefixes(req.prompt_ids, req.shared_pages)
            assert req.pages[: req.shared_pages] == [self.cached[p] for p in prefixes]
            for index in range(req.shared_pages, len(req.pages)):
                assert self.content[req.pages[index]] == self._expected_content(req, index)

    @invariant()
    def ledger_agrees(self) -> None:
        owner: dict[int, Request | str] = dict.fromkeys(self.cached.values(), CACHE)
        holders: dict[int, set[Request]] = {}
        for req in self.live:
            owner.update(dict.fromkeys(self._private(req), req))
            for page in req.pages[: req.shared_pages]:
                holders.setdefault(page, set()).add(req)
        batches: dict[Request, list[int]] = {}
        for step, reqs in self.batches:
            for req in reqs:
                batches.setdefault(req, []).append(step)
        assert ledger_state(self.ledger) == (owner, holders, batches)

    def teardown(self) -> None:
        """Nothing leaks: finish everything, then the idle check; evicting everything
        then gives the pool back every page. Hypothesis calls this in a ``finally``:
        after a failed step it would only fail again, hiding the first failure."""
        if sys.exc_info()[1] is not None:
            return
        self._drain()
        self._evict(self.num_pages)
        assert not self.cached
        assert sorted(self.pool.free_page_list()) == list(range(1, self.num_pages))
        self.ledger.check_idle(self.pool.free_page_list(), self.radix.held_pages())


RadixLedgerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRadixLedger = RadixLedgerMachine.TestCase
