"""Radix prefix cache: KV pages shared across requests whose token sequences share a prefix.

``RadixCache`` is a radix tree over token ids, kept on the host, whose edges hold runs
of whole KV pages (a partial last page is never cached). Ownership rule, the contract
with the scheduler: pages given to ``insert`` belong to the cache from then on (it
frees duplicates itself; the caller frees none of them), and a request that matched a
prefix holds a lock on ``match.node``, not the pages. Eviction frees unlocked pages,
least recently used leaf first, by a counter rather than wall time, so reproducibly.
docs/concepts/memory.md, "The radix cache", states the contract in full.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

PageKey = tuple[int, ...]
"""The token ids of one page: what a page is compared and looked up by."""


@dataclass(eq=False, repr=False)
class RadixNode:
    """One edge of the tree and the node it leads to.

    ``keys[i]`` are the token ids of ``pages[i]``; the root has neither. Nodes compare by
    identity: a node is the handle a request locks, whatever its contents become.

    ``lock_ref`` counts the locks on this node *or any descendant*: eviction looks only at
    it (zero means evictable). ``own_locks`` counts the locks taken with this node as the
    handle, so that an unlock without a matching lock is caught even when a descendant's
    lock keeps ``lock_ref`` positive.

    A split keeps the original node object as the *lower* part, so a handle always ends
    where its match ended. A node removed from the tree has ``parent is None`` (and is not
    the root); locking it is an error.
    """

    node_id: int
    keys: list[PageKey] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    parent: RadixNode | None = None
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    own_locks: int = 0
    last_access: int = 0

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, pages={self.pages}, children={len(self.children)}, "
            f"lock_ref={self.lock_ref}, own_locks={self.own_locks}, "
            f"last_access={self.last_access})"
        )


@dataclass(frozen=True)
class PrefixMatch:
    """The result of ``match_prefix``. ``node`` is the lock handle: it ends exactly where
    the match ends, so locking it protects exactly ``pages`` (and nothing the request does
    not use)."""

    pages: list[int]
    num_tokens: int
    node: RadixNode


_Step = tuple[RadixNode, int]
"""A node on a lookup path and how many of its edge's pages matched (at least one)."""


class RadixCache:
    """Host-side radix tree from page-aligned token prefixes to the KV pages holding them.

    ``free_pages`` (the KV pool's ``free_pages``) receives the pages the cache lets go of:
    evicted pages, duplicates handed to ``insert``, everything on ``reset``. Each page goes
    back exactly once.
    """

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._free_pages = free_pages
        self._ids = itertools.count()
        self._clock = 0
        self._root = self._new_node()
        self._pages: set[int] = set()
        self._evictable = 0
        self._locked = 0

    # ------------------------------------------------------------------ public API

    @property
    def cached_pages(self) -> int:
        """Pages the cache holds, locked or not."""
        return self._evictable + self._locked

    @property
    def evictable_pages(self) -> int:
        """Pages held by unlocked nodes: all of them can be evicted."""
        return self._evictable

    def held_pages(self) -> frozenset[int]:
        """Every page the cache holds (for checks)."""
        return frozenset(self._pages)

    def match_prefix(self, tokens: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``tokens``, in whole pages.

        ``max_tokens`` caps the match, rounded down to whole pages: the caller passes
        ``len(tokens) - 1`` because the model must run on at least one token to produce
        the next token's logits. A match that ends inside an edge splits it there, so the
        returned node is a handle covering exactly the matched pages. The matched path
        becomes the most recently used.
        """
        limit = len(tokens) // self.page_size
        if max_tokens is not None:
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            limit = min(limit, max_tokens // self.page_size)
        path = self._walk(self._page_keys(tokens, limit))
        pages = [page for node, matched in path for page in node.pages[:matched]]
        end = self._end_of(path)
        self._touch(end)
        return PrefixMatch(pages=pages, num_tokens=len(pages) * self.page_size, node=end)

    def prefix_length(self, tokens: Sequence[int], max_tokens: int | None = None) -> int:
        """Tokens of ``tokens`` a ``match_prefix`` would match, without touching
        recency or splitting anything (for ordering a queue by cached prefix)."""
        limit = len(tokens) // self.page_size
        if max_tokens is not None:
            limit = min(limit, max(max_tokens, 0) // self.page_size)
        path = self._walk(self._page_keys(tokens, limit))
        return sum(matched for _, matched in path) * self.page_size

    def insert(self, tokens: Sequence[int], pages: list[int]) -> int:
        """Record that ``pages`` hold the K/V of ``tokens``; return how many pages the
        cache newly adopted (``cached_pages`` grows by exactly that).

        Only whole pages count: the first ``len(tokens) // page_size`` of ``pages``, and
        the cache takes all of them (see the module's ownership rule). Where a prefix is
        already cached, the cache keeps its own page; the caller's page there is either
        that same page (the request matched it) or a duplicate, which the cache frees.
        Everything is validated before anything changes, so a rejected call leaves the
        cache as it was.
        """
        num_whole = len(tokens) // self.page_size
        if len(pages) < num_whole:
            raise ValueError(
                f"{len(tokens)} tokens fill {num_whole} pages but only {len(pages)} were given"
            )
        given = pages[:num_whole]
        keys = self._page_keys(tokens, num_whole)
        path = self._walk(keys)
        cached = [page for node, matched in path for page in node.pages[:matched]]
        duplicates, adopted = self._sort_given(given, cached)

        end = self._end_of(path)
        if adopted:
            end = self._add_leaf(end, keys[len(cached) :], adopted)
        self._touch(end)
        if duplicates:
            self._free_pages(duplicates)
        return len(adopted)

    def lock(self, node: RadixNode) -> None:
        """Protect ``node``'s pages and all its ancestors' from eviction (one reference)."""
        path = self._path_to_root(node)
        node.own_locks += 1
        for step in path:
            if step.lock_ref == 0:
                self._move_pages(step, locked=True)
            step.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference taken by ``lock(node)``."""
        path = self._path_to_root(node)
        if node.own_locks == 0:
            raise RuntimeError(f"unlock of {node!r}, which holds no lock of its own")
        node.own_locks -= 1
        for step in path:
            step.lock_ref -= 1
            if step.lock_ref == 0:
                self._move_pages(step, locked=False)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages, least recently used leaf first; return
        how many were freed (``min(num_pages, evictable_pages)``).

        A leaf larger than what is still needed loses only its tail pages, so the cache
        keeps the prefix part, which more requests can reuse, and frees no more than asked.
        The tail is split off first, so a stale handle to the leaf becomes detached (and
        ``lock`` rejects it) rather than silently covering pages that are gone.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        freed: list[int] = []
        heap = [_lru_entry(leaf) for leaf in self._nodes() if self._is_evictable_leaf(leaf)]
        heapq.heapify(heap)
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            wanted = num_pages - len(freed)
            if len(leaf.pages) > wanted:
                self._split(leaf, len(leaf.pages) - wanted)
            parent = leaf.parent
            freed.extend(self._remove_leaf(leaf))
            if parent is not None and self._is_evictable_leaf(parent):
                heapq.heappush(heap, _lru_entry(parent))
        if freed:
            self._free_pages(freed)
        return len(freed)

    def reset(self) -> None:
        """Drop everything and free all pages. Every handle becomes stale."""
        if self._root.lock_ref > 0:
            raise RuntimeError(f"cannot reset the radix cache: {self._root.lock_ref} locks held")
        pages = [page for node in self._nodes() for page in node.pages]
        self._root = self._new_node()
        self._pages.clear()
        self._evictable = 0
        self._locked = 0
        if pages:
            self._free_pages(pages)

    def check(self) -> None:
        """Verify the tree against its own bookkeeping; raise ``RuntimeError`` on a
        violation. Cheap enough for tests to call after every step, too slow for the hot
        path."""
        root = self._root
        _require(root.parent is None and not root.keys and not root.pages, "root has an edge")
        seen: set[int] = set()
        evictable = locked = 0
        for node in self._nodes():
            self._check_node(node)
            for page in node.pages:
                _require(page not in seen, f"page {page} is held twice")
                seen.add(page)
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                locked += len(node.pages)
        _require(seen == self._pages, "the page set disagrees with the tree")
        _require(
            evictable == self._evictable,
            f"evictable count {self._evictable}, tree says {evictable}",
        )
        _require(locked == self._locked, f"locked count {self._locked}, tree says {locked}")

    # ------------------------------------------------------------------ lookup

    def _page_keys(self, tokens: Sequence[int], num_pages: int) -> list[PageKey]:
        """The first ``num_pages`` pages of ``tokens`` as keys. ``int()`` makes the keys
        hash by value whatever integer type the caller holds."""
        size = self.page_size
        return [tuple(int(t) for t in tokens[i * size : (i + 1) * size]) for i in range(num_pages)]

    def _walk(self, keys: Sequence[PageKey]) -> list[_Step]:
        """The path ``keys`` follows from the root, without changing anything. Only the
        last step can be partial (fewer pages matched than its edge has)."""
        path: list[_Step] = []
        node = self._root
        done = 0
        while done < len(keys):
            child = node.children.get(keys[done])
            if child is None:
                break
            matched = _common_length(child.keys, keys, done)
            path.append((child, matched))
            done += matched
            if matched < len(child.keys):
                break
            node = child
        return path

    def _end_of(self, path: list[_Step]) -> RadixNode:
        """The node ending exactly where ``path`` ends, splitting a partial last edge."""
        if not path:
            return self._root
        node, matched = path[-1]
        if matched < len(node.keys):
            return self._split(node, matched)
        return node

    def _sort_given(self, given: list[int], cached: list[int]) -> tuple[list[int], list[int]]:
        """Split the caller's whole pages into duplicates (to free) and pages to adopt,
        rejecting anything that would make the cache hold or free a page twice."""
        for page in given:
            if page < 1:
                raise ValueError(f"page {page} is not a KV page (page 0 is padding)")
        if len(set(given)) != len(given):
            raise ValueError(f"a page appears twice in {given}")
        duplicates = [mine for mine, theirs in zip(given, cached, strict=False) if mine != theirs]
        adopted = given[len(cached) :]
        for page in duplicates + adopted:
            if page in self._pages:
                raise ValueError(
                    f"page {page} is already cached for another prefix; it cannot be freed "
                    "as a duplicate nor cached twice"
                )
        return duplicates, adopted

    # ------------------------------------------------------------------ tree edits

    def _new_node(self) -> RadixNode:
        return RadixNode(node_id=next(self._ids), last_access=self._clock)

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node``'s edge after ``at`` pages; return the new upper node. The original
        object keeps the lower part so that handles keep their meaning. Both parts share
        the lock state, so the page counts do not move."""
        parent = node.parent
        if parent is None or not 0 < at < len(node.keys):
            raise RuntimeError(f"cannot split {node!r} after {at} pages")
        upper = self._new_node()
        upper.keys, node.keys = node.keys[:at], node.keys[at:]
        upper.pages, node.pages = node.pages[:at], node.pages[at:]
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.parent = parent
        parent.children[upper.keys[0]] = upper
        upper.children[node.keys[0]] = node
        node.parent = upper
        return upper

    def _add_leaf(self, parent: RadixNode, keys: list[PageKey], pages: list[int]) -> RadixNode:
        leaf = self._new_node()
        leaf.keys = keys
        leaf.pages = pages
        leaf.parent = parent
        parent.children[keys[0]] = leaf
        self._pages.update(pages)
        self._evictable += len(pages)
        return leaf

    def _remove_leaf(self, leaf: RadixNode) -> list[int]:
        """Detach an unlocked leaf; return its pages for the caller to free."""
        parent = leaf.parent
        if parent is None or leaf.children or leaf.lock_ref:
            raise RuntimeError(f"{leaf!r} is not an evictable leaf")
        del parent.children[leaf.keys[0]]
        pages = leaf.pages
        leaf.parent = None
        leaf.pages = []
        self._pages.difference_update(pages)
        self._evictable -= len(pages)
        return pages

    def _touch(self, node: RadixNode) -> None:
        """Mark ``node`` and its ancestors most recently used. Ancestors are always at
        least as recent as their descendants, so a parent that becomes a leaf is never
        evicted ahead of older leaves."""
        self._clock += 1
        step: RadixNode | None = node
        while step is not None:
            step.last_access = self._clock
            step = step.parent

    def _move_pages(self, node: RadixNode, *, locked: bool) -> None:
        """Move ``node``'s pages between the evictable and locked counts."""
        delta = len(node.pages) if locked else -len(node.pages)
        self._evictable -= delta
        self._locked += delta

    # ------------------------------------------------------------------ traversal

    def _path_to_root(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and its ancestors, root last; a node no longer in the tree (evicted,
        or from before a reset) is an error, since its pages may belong to someone else."""
        path = [node]
        while (parent := path[-1].parent) is not None:
            path.append(parent)
        if path[-1] is not self._root:
            raise RuntimeError(
                f"{node!r} is no longer in the radix cache (evicted or reset); "
                "lock a match before anything can evict"
            )
        return path

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node, root first, depth first; iterative because page_size 1 makes
        deep trees."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self._root and not node.children and node.lock_ref == 0

    def _check_node(self, node: RadixNode) -> None:
        _require(node.own_locks >= 0, f"{node!r} has negative own locks")
        child_locks = sum(child.lock_ref for child in node.children.values())
        _require(
            node.lock_ref == node.own_locks + child_locks,
            f"{node!r}: lock_ref != own_locks + children's lock_ref ({child_locks})",
        )
        for key, child in node.children.items():
            _require(child.parent is node, f"{child!r} does not point back to its parent")
            _require(bool(child.keys), f"{child!r} has an empty edge")
            _require(child.keys[0] == key, f"{child!r} is filed under the wrong key")
            _require(len(child.keys) == len(child.pages), f"{child!r}: keys and pages differ")
            _require(
                all(len(k) == self.page_size for k in child.keys),
                f"{child!r} has a key that is not one page long",
            )
            _require(
                child.last_access <= node.last_access,
                f"{child!r} is more recent than its parent",
            )


def _common_length(edge: list[PageKey], keys: Sequence[PageKey], start: int) -> int:
    """How many leading pages of ``edge`` equal ``keys[start:]``."""
    count = 0
    limit = min(len(edge), len(keys) - start)
    while count < limit and edge[count] == keys[start + count]:
        count += 1
    return count


def _lru_entry(node: RadixNode) -> tuple[int, int, RadixNode]:
    """Heap order: least recently used first; the node id breaks ties deterministically
    (and keeps the heap from ever comparing nodes)."""
    return (node.last_access, node.node_id, node)


def _require(condition: bool, message: str) -> None:
    """``check``'s assertion: a real exception, so it survives ``python -O``."""
    if not condition:
        raise RuntimeError(f"radix cache inconsistent: {message}")
