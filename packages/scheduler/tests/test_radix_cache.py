"""The radix prefix cache: matching, inserting, splitting, locks, LRU eviction, and a
stateful test that drives the cache like the scheduler does, against a plain-Python model
of page-aligned prefixes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tandem.scheduler.kv.radix_cache import PrefixMatch, RadixCache, RadixNode

PAGE_SIZES = [1, 4, 16]


class FreeLog:
    """Stands in for the KV pool's ``free_pages``: records every call, and fails on a
    page freed twice."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.freed: set[int] = set()

    def __call__(self, pages: list[int]) -> None:
        for page in pages:
            assert page not in self.freed, f"page {page} freed twice"
            self.freed.add(page)
        self.calls.append(list(pages))

    @property
    def pages(self) -> list[int]:
        return [page for call in self.calls for page in call]


def seq(page_ids: list[int], page_size: int, tail: int = 0) -> list[int]:
    """Tokens made of whole pages (page ``a`` is ``a`` repeated, so pages with different
    ids differ in every token) plus ``tail`` extra tokens."""
    tokens = [a for a in page_ids for _ in range(page_size)]
    return tokens + [99] * tail


def make(page_size: int) -> tuple[RadixCache, FreeLog]:
    log = FreeLog()
    return RadixCache(page_size, log), log


# ---------------------------------------------------------------------- match / insert


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_empty_cache_matches_nothing(page_size: int) -> None:
    cache, log = make(page_size)
    match = cache.match_prefix(seq([1, 2], page_size))
    assert match.pages == []
    assert match.num_tokens == 0
    assert match.node.parent is None  # the root
    assert cache.cached_pages == 0
    assert log.calls == []
    cache.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_insert_then_match_whole_and_partial(page_size: int) -> None:
    cache, log = make(page_size)
    tokens = seq([1, 2, 3], page_size)
    assert cache.insert(tokens, [10, 11, 12]) == 3
    assert cache.cached_pages == 3
    assert cache.evictable_pages == 3

    full = cache.match_prefix(tokens)
    assert full == PrefixMatch(pages=[10, 11, 12], num_tokens=3 * page_size, node=full.node)
    # a longer query matches what is cached; a diverging one stops at the last equal page
    assert cache.match_prefix(seq([1, 2, 3, 4], page_size, tail=1)).pages == [10, 11, 12]
    assert cache.match_prefix(seq([1, 2, 7], page_size)).pages == [10, 11]
    assert cache.match_prefix(seq([2], page_size)).pages == []
    assert log.calls == []
    cache.check()


@pytest.mark.parametrize("page_size", [4, 16])
def test_match_never_takes_a_partial_page(page_size: int) -> None:
    cache, _ = make(page_size)
    tokens = seq([1, 2], page_size)
    cache.insert(tokens, [5, 6])
    # the second page differs only in its last token: that page does not match
    query = [*tokens[: 2 * page_size - 1], 42]
    assert cache.match_prefix(query).pages == [5]
    # a query ending inside a page matches only the whole pages before it
    assert cache.match_prefix(tokens[: 2 * page_size - 1]).pages == [5]
    assert cache.match_prefix(tokens[: page_size - 1]).pages == []
    cache.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_insert_ignores_the_partial_last_page(page_size: int) -> None:
    cache, log = make(page_size)
    tokens = seq([1, 2], page_size, tail=page_size - 1)
    # three pages held, the last one partial: only the two whole pages are taken
    assert cache.insert(tokens, [7, 8, 9]) == 2
    assert cache.cached_pages == 2
    assert cache.match_prefix(tokens).pages == [7, 8]
    assert log.calls == []
    cache.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_diverging_insert_splits_at_a_page_boundary(page_size: int) -> None:
    cache, _ = make(page_size)
    a = seq([1, 2, 3], page_size)
    b = seq([1, 2, 4, 5], page_size)
    cache.insert(a, [10, 11, 12])
    assert cache.insert(b, [10, 11, 20, 21]) == 2
    cache.check()

    match_a = cache.match_prefix(a)
    match_b = cache.match_prefix(b)
    assert match_a.pages == [10, 11, 12]
    assert match_b.pages == [10, 11, 20, 21]
    shared = match_a.node.parent
    assert shared is not None
    assert shared is match_b.node.parent
    assert shared.pages == [10, 11]
    assert match_a.node.pages == [12]
    assert match_b.node.pages == [20, 21]
    assert cache.cached_pages == 5


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_match_inside_an_edge_splits_so_the_handle_covers_the_match(page_size: int) -> None:
    cache, _ = make(page_size)
    tokens = seq([1, 2, 3], page_size)
    cache.insert(tokens, [10, 11, 12])
    leaf = cache.match_prefix(tokens).node
    assert leaf.pages == [10, 11, 12]

    short = cache.match_prefix(tokens[: 2 * page_size])
    assert short.pages == [10, 11]
    assert short.node.pages == [10, 11]
    # the original node object keeps the lower part: an older handle still ends at its end
    assert leaf.pages == [12]
    assert leaf.parent is short.node
    cache.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_insert_that_ends_inside_an_edge_splits(page_size: int) -> None:
    cache, _ = make(page_size)
    cache.insert(seq([1, 2, 3], page_size), [10, 11, 12])
    assert cache.insert(seq([1], page_size), [10]) == 0
    assert cache.match_prefix(seq([1], page_size)).node.pages == [10]
    assert cache.cached_pages == 3
    cache.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_max_tokens_caps_the_match_in_whole_pages(page_size: int) -> None:
    cache, _ = make(page_size)
    tokens = seq([1, 2], page_size)
    cache.insert(tokens, [3, 4])
    # the caller's usual cap, len - 1, keeps one token to run when all of it is cached
    assert cache.match_prefix(tokens, max_tokens=len(tokens) - 1).pages == [3]
    assert cache.match_prefix(tokens, max_tokens=len(tokens)).pages == [3, 4]
    assert cache.match_prefix(tokens, max_tokens=10 * page_size).pages == [3, 4]
    assert cache.match_prefix(tokens, max_tokens=page_size).pages == [3]
    assert cache.match_prefix(tokens, max_tokens=page_size - 1).pages == []
    assert cache.match_prefix(tokens, max_tokens=0).pages == []
    with pytest.raises(ValueError, match="max_tokens"):
        cache.match_prefix(tokens, max_tokens=-1)
    cache.check()


def test_page_size_one_is_token_level() -> None:
    cache, _ = make(1)
    cache.insert([5, 6, 7, 8], [1, 2, 3, 4])
    cache.insert([5, 6, 9], [1, 2, 5])
    assert cache.match_prefix([5, 6, 7, 0]).pages == [1, 2, 3]
    assert cache.match_prefix([5, 6, 9, 9]).pages == [1, 2, 5]
    assert cache.match_prefix([5, 0]).pages == [1]
    assert cache.match_prefix([5, 6, 7, 8], max_tokens=3).num_tokens == 3
    cache.check()


def test_tokens_of_any_integer_type_key_alike() -> None:
    cache, _ = make(2)
    cache.insert((1, 2, 3, 4), [1, 2])
    assert cache.match_prefix(range(1, 5)).pages == [1, 2]


# ---------------------------------------------------------------------- duplicates


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_duplicates_are_freed_by_the_cache_exactly_once(page_size: int) -> None:
    cache, log = make(page_size)
    tokens = seq([1, 2, 3], page_size)
    cache.insert(tokens, [1, 2, 3])
    # another request computed the same prefix into its own pages
    assert cache.insert(tokens, [4, 5, 6]) == 0
    assert log.calls == [[4, 5, 6]]
    assert cache.cached_pages == 3
    assert cache.match_prefix(tokens).pages == [1, 2, 3]

    # a request that matched two pages, computed the rest itself (9: partial or unused)
    longer = seq([1, 2, 3, 4], page_size, tail=page_size - 1)
    assert cache.insert(longer, [1, 2, 7, 8, 9]) == 1
    assert log.calls == [[4, 5, 6], [7]]
    assert cache.match_prefix(longer).pages == [1, 2, 3, 8]
    assert cache.cached_pages == 4
    cache.check()


def test_insert_rejects_bad_pages_and_changes_nothing() -> None:
    cache, log = make(2)
    cache.insert(seq([1, 2], 2), [1, 2])
    with pytest.raises(ValueError, match="only 1 were given"):
        cache.insert(seq([3, 4], 2), [5])
    with pytest.raises(ValueError, match="padding"):
        cache.insert(seq([3], 2), [0])
    with pytest.raises(ValueError, match="twice"):
        cache.insert(seq([3, 4], 2), [5, 5])
    # page 2 is cached for [1, 2]: it can be neither adopted nor freed as a duplicate
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(seq([3, 4], 2), [5, 2])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(seq([1, 2], 2), [2, 1])
    assert log.calls == []
    assert cache.cached_pages == 2
    assert cache.match_prefix(seq([1, 2], 2)).pages == [1, 2]
    assert cache.match_prefix(seq([3], 2)).pages == []
    cache.check()


# ---------------------------------------------------------------------- eviction


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_eviction_is_least_recently_used_first(page_size: int) -> None:
    cache, log = make(page_size)
    cache.insert(seq([1], page_size), [1])
    cache.insert(seq([2], page_size), [2])
    cache.insert(seq([3], page_size), [3])
    cache.match_prefix(seq([1], page_size))  # 1 becomes the most recent
    assert cache.evict(1) == 1
    assert cache.evict(1) == 1
    assert log.calls == [[2], [3]]
    assert cache.evict(5) == 1
    assert log.pages == [2, 3, 1]
    assert cache.evict(1) == 0
    assert cache.cached_pages == 0
    cache.check()


def test_insert_refreshes_recency() -> None:
    cache, log = make(1)
    cache.insert([1], [1])
    cache.insert([2], [2])
    cache.insert([1], [3])  # a duplicate, but the path is still used
    cache.evict(1)
    assert log.calls == [[3], [2]]


def test_evicting_a_leaf_exposes_its_parent() -> None:
    cache, log = make(1)
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([1, 2, 4], [1, 2, 4])  # parent [1, 2] with leaves [3] and [4]
    cache.insert([9], [9])  # most recent
    assert cache.evict(1) == 1
    assert cache.evict(1) == 1
    assert log.pages == [3, 4]
    # the parent is now a leaf, older than [9]
    assert cache.evict(2) == 2
    assert sorted(log.calls[-1]) == [1, 2]
    assert cache.match_prefix([9]).pages == [9]
    cache.check()


def test_eviction_trims_a_leaf_and_keeps_its_prefix() -> None:
    cache, log = make(2)
    tokens = seq([1, 2, 3, 4], 2)
    cache.insert(tokens, [1, 2, 3, 4])
    assert cache.evict(1) == 1
    assert log.calls == [[4]]
    assert cache.match_prefix(tokens).pages == [1, 2, 3]
    assert cache.evict(2) == 2
    assert cache.match_prefix(tokens).pages == [1]
    assert cache.cached_pages == 1
    cache.check()


def test_evict_argument_checks() -> None:
    cache, _ = make(1)
    cache.insert([1], [1])
    assert cache.evict(0) == 0
    with pytest.raises(ValueError, match="num_pages"):
        cache.evict(-1)
    assert cache.cached_pages == 1


# ---------------------------------------------------------------------- locks


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lock_protects_the_node_and_its_ancestors(page_size: int) -> None:
    cache, log = make(page_size)
    cache.insert(seq([1, 2, 3], page_size), [1, 2, 3])
    cache.insert(seq([1, 2, 4, 5], page_size), [1, 2, 4, 5])
    cache.insert(seq([6], page_size), [6])
    match = cache.match_prefix(seq([1, 2, 4, 5], page_size))
    cache.lock(match.node)
    assert cache.evictable_pages == 2  # [3] and [6]
    assert cache.cached_pages == 6

    assert cache.evict(100) == 2
    assert sorted(log.pages) == [3, 6]
    # the shared ancestor [1, 2] was not evicted even though its other child is gone
    assert cache.match_prefix(seq([1, 2, 4, 5], page_size)).pages == [1, 2, 4, 5]
    cache.check()

    cache.unlock(match.node)
    assert cache.evictable_pages == 4
    assert cache.evict(100) == 4
    assert sorted(log.pages) == [1, 2, 3, 4, 5, 6]
    cache.check()


def test_a_lock_on_a_short_match_protects_only_its_prefix() -> None:
    cache, log = make(1)
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 3, 4], max_tokens=2)
    cache.lock(match.node)
    assert cache.evictable_pages == 2
    assert cache.evict(10) == 2
    assert sorted(log.pages) == [3, 4]
    assert cache.match_prefix([1, 2, 3, 4]).pages == [1, 2]
    cache.unlock(match.node)
    cache.check()


def test_locks_count_and_unlock_errors() -> None:
    cache, _ = make(1)
    cache.insert([1, 2], [1, 2])
    child = cache.match_prefix([1, 2]).node
    parent = cache.match_prefix([1]).node
    cache.lock(child)
    cache.lock(child)
    cache.unlock(child)
    assert cache.evictable_pages == 0
    # the parent's count is positive only through the child: unlocking it is a bug
    with pytest.raises(RuntimeError, match="no lock of its own"):
        cache.unlock(parent)
    cache.unlock(child)
    assert cache.evictable_pages == 2
    with pytest.raises(RuntimeError, match="no lock of its own"):
        cache.unlock(child)
    cache.check()


def test_the_root_can_be_locked_for_an_empty_match() -> None:
    cache, _ = make(4)
    cache.insert(seq([1], 4), [1])
    match = cache.match_prefix(seq([2], 4))
    assert match.pages == []
    cache.lock(match.node)
    assert cache.evictable_pages == 1
    with pytest.raises(RuntimeError, match="locks held"):
        cache.reset()
    cache.unlock(match.node)
    cache.check()


def test_a_stale_handle_cannot_be_locked() -> None:
    cache, _ = make(1)
    cache.insert([1, 2, 3], [1, 2, 3])
    match = cache.match_prefix([1, 2, 3])
    cache.evict(1)  # trims the tail page out of the matched node
    with pytest.raises(RuntimeError, match="no longer in the radix cache"):
        cache.lock(match.node)
    assert cache.match_prefix([1, 2, 3]).pages == [1, 2]
    cache.check()


# ---------------------------------------------------------------------- reset / check


def test_reset_frees_everything_once_and_invalidates_handles() -> None:
    cache, log = make(2)
    cache.insert(seq([1, 2], 2), [1, 2])
    cache.insert(seq([1, 3], 2), [1, 3])
    match = cache.match_prefix(seq([1, 3], 2))
    cache.lock(match.node)
    with pytest.raises(RuntimeError, match="locks held"):
        cache.reset()
    cache.unlock(match.node)
    cache.reset()
    assert sorted(log.pages) == [1, 2, 3]
    assert cache.cached_pages == 0
    assert cache.evictable_pages == 0
    with pytest.raises(RuntimeError, match="no longer in the radix cache"):
        cache.lock(match.node)
    cache.reset()  # nothing left: frees nothing
    assert len(log.calls) == 1
    cache.check()
    # the pages can be inserted again after the pool hands them out anew
    cache.insert(seq([1, 2], 2), [1, 2])
    cache.check()


def test_check_reports_corruption() -> None:
    cache, _ = make(1)
    cache.insert([1, 2], [1, 2])
    node: RadixNode = cache.match_prefix([1, 2]).node
    node.lock_ref = 1
    with pytest.raises(RuntimeError, match="lock_ref"):
        cache.check()
    node.lock_ref = 0
    node.pages.append(7)
    with pytest.raises(RuntimeError, match="keys and pages"):
        cache.check()


def test_bad_page_size() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(0, lambda pages: None)


# ---------------------------------------------------------------------- stateful model

NUM_PAGES = 40  # pages 1..39; page 0 is padding, as in the KV pool
Prefix = tuple[int, ...]


@dataclass
class ModelRequest:
    """A request between admission and finish, as the scheduler holds it."""

    tokens: list[int]
    pages: list[int]  # matched (the cache's) pages, then its own
    matched: int  # how many leading pages came from the cache
    node: RadixNode
    prefix: Prefix  # the matched tokens: what the lock protects


@dataclass
class Model:
    """The cache as a plain dict: every cached page-aligned prefix -> the page holding its
    last page, and when it was last used."""

    page_size: int
    pages: dict[Prefix, int] = field(default_factory=dict)
    used: dict[Prefix, int] = field(default_factory=dict)
    clock: int = 0
    locks: list[Prefix] = field(default_factory=list)

    def prefixes(self, tokens: list[int], num_pages: int) -> list[Prefix]:
        return [tuple(tokens[: k * self.page_size]) for k in range(1, num_pages + 1)]

    def match(self, tokens: list[int], max_tokens: int | None) -> list[int]:
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        self.clock += 1
        out = []
        for prefix in self.prefixes(tokens, limit // self.page_size):
            if prefix not in self.pages:
                break
            out.append(self.pages[prefix])
            self.used[prefix] = self.clock
        return out

    def insert(self, tokens: list[int], given: list[int]) -> tuple[int, list[int]]:
        """Returns (pages adopted, duplicates to free)."""
        self.clock += 1
        adopted, duplicates = 0, []
        for prefix, page in zip(self.prefixes(tokens, len(given)), given, strict=True):
            if prefix not in self.pages:
                self.pages[prefix] = page
                adopted += 1
            elif self.pages[prefix] != page:
                duplicates.append(page)
            self.used[prefix] = self.clock
        return adopted, duplicates

    def locked(self, prefix: Prefix) -> bool:
        return any(held[: len(prefix)] == prefix for held in self.locks if len(held) >= len(prefix))

    def is_leaf(self, prefix: Prefix) -> bool:
        size = len(prefix) + self.page_size
        return not any(len(p) == size and p[: len(prefix)] == prefix for p in self.pages)

    @property
    def evictable(self) -> int:
        return sum(1 for prefix in self.pages if not self.locked(prefix))

    def evict(self, num_pages: int) -> list[int]:
        """One page at a time: the least recently used unlocked leaf prefix. The oldest is
        unique: prefixes used by one operation form a single chain."""
        freed = []
        for _ in range(num_pages):
            leaves = [p for p in self.pages if not self.locked(p) and self.is_leaf(p)]
            if not leaves:
                break
            oldest = min(self.used[p] for p in leaves)
            victims = [p for p in leaves if self.used[p] == oldest]
            assert len(victims) == 1, f"LRU tie between {victims}"
            freed.append(self.pages.pop(victims[0]))
            del self.used[victims[0]]
        return freed


def page_tokens(page_id: int, page_size: int) -> list[int]:
    """Pages differ only in their last token, so a divergence inside a page is common."""
    return [0] * (page_size - 1) + [page_id]


@st.composite
def token_seqs(draw: st.DrawFn, page_size: int) -> list[int]:
    page_ids = draw(st.lists(st.integers(0, 2), max_size=5))
    tail = draw(st.integers(0, page_size - 1))
    tokens = [t for a in page_ids for t in page_tokens(a, page_size)]
    return tokens + [0] * tail


class RadixCacheMachine(RuleBasedStateMachine):
    """Drives the cache the way the scheduler will (match + lock at admission, insert +
    free the partial page + unlock at finish), with extra inserts of freshly computed
    pages (the source of duplicates), plain matches, locks, and evictions.

    Every page is always in exactly one place: the pool's free set, the cache, or a live
    request's own pages. The pool's free set doubles as the exactly-once check."""

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 1
        self.free: set[int] = set(range(1, NUM_PAGES))
        self.cache = RadixCache(1, self._on_free)
        self.model = Model(1)
        self.requests: list[ModelRequest] = []
        self.handles: list[tuple[RadixNode, Prefix]] = []
        self.just_freed: list[int] = []

    def _on_free(self, pages: list[int]) -> None:
        for page in pages:
            assert page not in self.free, f"page {page} returned to the pool twice"
            self.free.add(page)
        self.just_freed.extend(pages)

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def set_page_size(self, page_size: int) -> None:
        self.page_size = page_size
        self.cache = RadixCache(page_size, self._on_free)
        self.model = Model(page_size)

    # -------------------------------------------------------------- helpers

    def _match(self, tokens: list[int], max_tokens: int | None) -> PrefixMatch:
        match = self.cache.match_prefix(tokens, max_tokens)
        expected = self.model.match(tokens, max_tokens)
        assert match.pages == expected
        assert match.num_tokens == len(expected) * self.page_size
        return match

    def _lock(self, match: PrefixMatch, tokens: list[int]) -> Prefix:
        self.cache.lock(match.node)
        prefix = tuple(tokens[: match.num_tokens])
        self.model.locks.append(prefix)
        return prefix

    def _unlock(self, node: RadixNode, prefix: Prefix) -> None:
        self.cache.unlock(node)
        self.model.locks.remove(prefix)

    def _evict(self, num_pages: int) -> None:
        self.just_freed = []
        expected = self.model.evict(num_pages)
        assert self.cache.evict(num_pages) == len(expected)
        assert sorted(self.just_freed) == sorted(expected)

    def _alloc(self, count: int) -> list[int] | None:
        """Like the scheduler: evict what is missing, then take pages lowest first."""
        if count > len(self.free):
            self._evict(count - len(self.free))
        if count > len(self.free):
            return None
        pages = sorted(self.free)[:count]
        self.free.difference_update(pages)
        return pages

    def _insert(self, tokens: list[int], pages: list[int]) -> None:
        whole = len(tokens) // self.page_size
        self.just_freed = []
        adopted, duplicates = self.model.insert(tokens, pages[:whole])
        assert self.cache.insert(tokens, pages) == adopted
        assert self.just_freed == duplicates

    # -------------------------------------------------------------- rules

    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        tokens = data.draw(token_seqs(self.page_size).filter(bool))
        # usually the scheduler's cap; sometimes a shorter one, so a later insert
        # finds pages the request computed itself already cached (duplicates)
        cap = data.draw(st.one_of(st.just(len(tokens) - 1), st.integers(0, len(tokens))))
        match = self._match(tokens, cap)
        prefix = self._lock(match, tokens)
        own = self._alloc(math.ceil(len(tokens) / self.page_size) - len(match.pages))
        if own is None:
            self._unlock(match.node, prefix)
            return
        request = ModelRequest(tokens, match.pages + own, len(match.pages), match.node, prefix)
        self.requests.append(request)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        self.finish_request_at(data.draw(st.integers(0, len(self.requests) - 1)))

    def finish_request_at(self, index: int) -> None:
        request = self.requests.pop(index)
        self._insert(request.tokens, request.pages)
        whole = len(request.tokens) // self.page_size
        self._on_free(request.pages[whole:])  # the scheduler frees the partial page
        self._unlock(request.node, request.prefix)

    @rule(data=st.data())
    def insert_fresh(self, data: st.DataObject) -> None:
        tokens = data.draw(token_seqs(self.page_size))
        pages = self._alloc(len(tokens) // self.page_size)
        if pages is not None:
            self._insert(tokens, pages)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = data.draw(token_seqs(self.page_size))
        cap = data.draw(st.none() | st.integers(0, len(tokens) + 2))
        self._match(tokens, cap)

    @rule(data=st.data())
    def lock_a_match(self, data: st.DataObject) -> None:
        tokens = data.draw(token_seqs(self.page_size))
        match = self._match(tokens, None)
        self.handles.append((match.node, self._lock(match, tokens)))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unlock_a_match(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.handles) - 1))
        self._unlock(*self.handles.pop(index))

    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages: int) -> None:
        self._evict(num_pages)

    @precondition(lambda self: not self.requests and not self.handles)
    @rule()
    def reset(self) -> None:
        self.just_freed = []
        expected = sorted(self.model.pages.values())
        self.cache.reset()
        assert sorted(self.just_freed) == expected
        self.model = Model(self.page_size, clock=self.model.clock)

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        self.cache.check()

    @invariant()
    def every_page_has_one_place(self) -> None:
        cached = list(self.model.pages.values())
        owned = [page for r in self.requests for page in r.pages[r.matched :]]
        places = sorted(cached + owned + list(self.free))
        assert places == list(range(1, NUM_PAGES))
        assert self.cache.cached_pages == len(cached)
        assert self.cache.evictable_pages == self.model.evictable
        for r in self.requests:  # a locked match keeps its pages
            prefixes = self.model.prefixes(r.tokens, r.matched)
            assert r.pages[: r.matched] == [self.model.pages[p] for p in prefixes]

    @rule()
    def drain_to_idle(self) -> None:
        """The scheduler's strict accounting at idle: once every request has finished and
        every lock is gone, evicting everything returns every page to the pool."""
        while self.requests:
            self.finish_request_at(0)
        while self.handles:
            self._unlock(*self.handles.pop())
        self._evict(NUM_PAGES)
        assert self.cache.cached_pages == 0
        assert self.free == set(range(1, NUM_PAGES))


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
test_radix_cache_against_model = RadixCacheMachine.TestCase
