"""Rows and KV pages: what a request holds, with the radix cache and the page ledger.

A request gets a row and its cached prefix when it is admitted, pages as its batches
need them, and gives everything back in ``free``, where its computed K/V goes into
the radix cache. With strict accounting the ``PageLedger`` checks every hand-over.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.scheduler.kv.page_ledger import PageLedger
from tandem.scheduler.kv.pools import PagedKVPool, ReqToTokenPool
from tandem.scheduler.kv.radix_cache import RadixCache
from tandem.scheduler.messages import ScheduledBatch
from tandem.scheduler.request import Request


class Resources:
    """The request pool's rows and the KV pool's pages, handed to requests."""

    def __init__(
        self,
        req_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        *,
        radix: bool,
        evict_ahead: int,
        discard_rows: Callable[[list[int]], None],
        strict: bool,
    ) -> None:
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.ledger = PageLedger(kv_pool.num_pages) if strict else None
        self.radix = RadixCache(kv_pool.page_size, self._cache_frees) if radix else None
        self._evict_ahead = evict_ahead
        self._discard_rows = discard_rows  # the runner forgets a freed row's futures

    def available_pages(self) -> int:
        evictable = self.radix.evictable_pages if self.radix is not None else 0
        return self.kv_pool.available_pages + evictable

    def pages_short(self, req: Request, end: int) -> int:
        """Pages ``req`` still needs to hold positions below ``end``."""
        return max(0, self.kv_pool.pages_for(end) - len(req.pages))

    def cached_prefix(self, req: Request) -> int:
        """Tokens of ``req``'s fill the radix cache could serve it (0 without it)."""
        if self.radix is None:
            return 0
        return self.radix.prefix_length(req.fill_ids, req.prefix_limit)

    def admit(self, req: Request, first_chunk: int, reserve: int) -> bool:
        """Give ``req`` a row and its cached prefix (``req.kv_len``, at most
        ``req.prefix_limit``), if its first chunk fits after ``reserve`` pages kept for
        decoding requests."""
        fill = req.fill_ids
        match = None
        if self.radix is not None:
            match = self.radix.match_prefix(fill, max_tokens=req.prefix_limit)
            self.radix.lock(match.node)
        cached = match.num_tokens if match is not None else 0
        first = min(len(fill) - cached, first_chunk)
        need = self.kv_pool.pages_for(cached + first) - (len(match.pages) if match else 0)
        row = self.req_pool.alloc() if need + reserve <= self.available_pages() else None
        if row is None:
            if match is not None:
                self.radix.unlock(match.node)  # type: ignore[union-attr]
            return False
        req.row = row
        if match is not None:
            req.prefix_node = match.node
            req.pages = list(match.pages)
            req.shared_pages = len(match.pages)
            if self.ledger is not None:
                self.ledger.hold(req, match.pages)
        req.kv_len = cached
        return True

    def reserve(self, req: Request, end: int) -> bool:
        """Make ``req`` hold pages for token positions below ``end``."""
        need = self.pages_short(req, end)
        if need == 0:
            return True
        short = need - self.kv_pool.available_pages
        if short > 0 and self.radix is not None:
            # Evict ahead, a page for every row: a decode step reserves for each
            # request in turn, and each eviction walks the whole tree.
            self.radix.evict(max(short, self._evict_ahead))
        pages = self.kv_pool.alloc_pages(need)
        if pages is None:
            return False
        if self.ledger is not None:
            self.ledger.take(req, pages)
        req.pages.extend(pages)
        return True

    def free(self, req: Request) -> None:
        """Give back ``req``'s row and pages; its whole computed pages (below
        ``kv_len``) go into the radix cache for later requests to share."""
        if req.row is None:
            return  # never admitted: it holds nothing
        ledger = self.ledger
        whole = 0
        if self.radix is not None:
            seq = (req.prompt_ids + req.output_ids)[: req.kv_len]
            whole = len(seq) // self.kv_pool.page_size
            if ledger is not None:
                ledger.adopt(req, req.pages[:whole])
            self.radix.insert(seq, req.pages[:whole])
        if ledger is not None:
            ledger.free(req, req.pages[whole:])
        self.kv_pool.free_pages(req.pages[whole:])
        if req.prefix_node is not None:
            assert self.radix is not None
            if ledger is not None:
                ledger.unhold(req, req.pages[: req.shared_pages])
            self.radix.unlock(req.prefix_node)
        req.pages, req.shared_pages, req.prefix_node = [], 0, None
        self._discard_rows([req.row])
        self.req_pool.free(req.row)
        req.row = None

    def launch(self, batch: ScheduledBatch, lookahead: int | None) -> None:
        """Strict accounting: the pages ``batch`` writes, per request (its new tokens'
        slots, or with ``lookahead`` a speculative step's lookahead slots)."""
        if self.ledger is None:
            return
        size = self.kv_pool.page_size
        if lookahead is not None:
            slots, counts = batch.table_slots, [lookahead] * len(batch.reqs)
        else:
            slots, counts = batch.out_cache_loc, batch.extend_lens
        writes, start = [], 0
        for req, n in zip(batch.reqs, counts, strict=True):
            writes.append((req, {slot // size for slot in slots[start : start + n]}))
            start += n
        self.ledger.launch(batch.step, writes)

    def settle(self, batch: ScheduledBatch) -> None:
        if self.ledger is not None:
            self.ledger.settle(batch.step, batch.reqs)

    def _cache_frees(self, pages: list[int]) -> None:
        """The radix cache lets go of ``pages`` (evicted, duplicates, reset)."""
        if self.ledger is not None:
            self.ledger.cache_frees(pages)
        self.kv_pool.free_pages(pages)

    def check_idle(self) -> None:
        """Strict accounting (docs/concepts/memory.md): when idle, every row is free and
        every KV page is either free or held, unlocked, by the radix cache."""
        held_rows = self.req_pool.num_rows - self.req_pool.available
        cached = self.radix.cached_pages if self.radix is not None else 0
        locked = cached - (self.radix.evictable_pages if self.radix is not None else 0)
        lost = self.kv_pool.num_pages - 1 - self.kv_pool.available_pages - cached
        if held_rows or lost or locked:
            raise RuntimeError(
                f"accounting at idle: {held_rows} rows held, {lost} KV pages neither free "
                f"nor cached, {locked} cached pages still locked"
            )
        if self.radix is not None:
            self.radix.check()
        if self.ledger is not None:
            held = self.radix.held_pages() if self.radix is not None else frozenset()
            self.ledger.check_idle(self.kv_pool.free_page_list(), held)
