"""The page ledger: who owns every KV page, checked at each hand-over (a debug invariant).

The KV pool only counts free pages and the radix cache only knows the pages it holds;
neither can tell that a page is being freed, evicted or written by the wrong party.
``PageLedger`` records one owner state per page (free, private to one request, or
cached and held by any number of requests), and the scheduler reports every hand-over
to it, so a violation raises ``PageOwnershipError`` when it happens, naming the page
and both parties. On in tests with the other debug invariants
(``TANDEM_DEBUG_FUTURES=1``). docs/concepts/memory.md, "Page ownership", lists the rules.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.scheduler.request import Request

CACHE = "the radix cache"


class PageOwnershipError(RuntimeError):
    """A KV page changed hands in a way the ownership rules forbid."""


def _party(owner: Request | str) -> str:
    return owner if isinstance(owner, str) else f"request {owner.rid!r}"


@dataclass
class PageLedger:
    """Owner state of every KV page. Page 0 is padding and never changes hands.

    Requests are keyed by identity, so two requests with the same id stay two parties.
    Each call checks every page before it changes anything, so a refused call leaves
    the ledger as it was.
    """

    num_pages: int
    _owner: dict[int, Request | str] = field(default_factory=dict)  # absent: free
    _holders: dict[int, set[Request]] = field(default_factory=dict)  # cached pages only
    _in_flight: dict[Request, list[int]] = field(default_factory=dict)  # batch numbers

    # -- requests -----------------------------------------------------------------------------
    def take(self, req: Request, pages: Collection[int]) -> None:
        """``pages`` came out of the pool for ``req``."""
        for page in pages:
            self._check_page(page)
            owner = self._owner.get(page)
            if owner is not None:
                raise PageOwnershipError(
                    f"page {page} handed to {_party(req)} while {_party(owner)} owns it"
                )
        _distinct(pages, f"handed to {_party(req)}")
        for page in pages:
            self._owner[page] = req

    def hold(self, req: Request, pages: Collection[int]) -> None:
        """``req`` reads ``pages`` through the cache prefix it locked."""
        for page in pages:
            owner = self._owner.get(page)
            if owner != CACHE:
                raise PageOwnershipError(
                    f"{_party(req)} matched page {page} in the radix cache, but "
                    f"{'nobody' if owner is None else _party(owner)} owns it"
                )
        for page in pages:
            self._holders.setdefault(page, set()).add(req)

    def unhold(self, req: Request, pages: Collection[int]) -> None:
        """``req`` no longer reads ``pages`` (its prefix lock is going)."""
        for page in pages:
            if req not in self._holders.get(page, ()):
                raise PageOwnershipError(f"{_party(req)} lets go of page {page} it never held")
        _distinct(pages, f"let go of by {_party(req)}")
        for page in pages:
            holders = self._holders[page]
            holders.discard(req)
            if not holders:
                del self._holders[page]

    def free(self, req: Request, pages: Collection[int]) -> None:
        """``req`` gives ``pages`` back to the pool."""
        for page in pages:
            self._check_owner(page, req, "freed")
            self._check_not_in_flight(req, page, "freed")
        _distinct(pages, f"freed by {_party(req)}")
        for page in pages:
            del self._owner[page]

    def adopt(self, req: Request, pages: Collection[int]) -> None:
        """``req`` hands its whole pages to the radix cache (``RadixCache.insert``): its
        private pages become cached; those that are cached already must be ones it
        holds. The cache then frees any duplicates itself (``cache_frees``)."""
        private = []
        for page in pages:
            owner = self._owner.get(page)
            if owner == CACHE:
                if req not in self._holders.get(page, ()):
                    raise PageOwnershipError(
                        f"{_party(req)} gives the radix cache page {page}, which the cache "
                        "holds for another prefix"
                    )
                continue
            self._check_owner(page, req, "given to the radix cache")
            self._check_not_in_flight(req, page, "given to the radix cache")
            private.append(page)
        _distinct(pages, "given to the radix cache")
        for page in private:
            self._owner[page] = CACHE

    # -- the radix cache ------------------------------------------------------------------------
    def cache_frees(self, pages: Collection[int]) -> None:
        """The radix cache frees ``pages`` (eviction, duplicates, reset)."""
        for page in pages:
            self._check_owner(page, CACHE, "freed by the radix cache")
            holders = self._holders.get(page)
            if holders:
                names = ", ".join(sorted(_party(r) for r in holders))
                raise PageOwnershipError(
                    f"page {page} freed by the radix cache while {names} holds it "
                    "through a locked prefix"
                )
        _distinct(pages, f"freed by {CACHE}")
        for page in pages:
            del self._owner[page]

    # -- batches --------------------------------------------------------------------------------
    def launch(self, number: int, writes: Collection[tuple[Request, Collection[int]]]) -> None:
        """Batch ``number`` is launched; it writes the given pages for each request
        (every request of the batch is listed, with the pages its K/V goes to)."""
        for req, pages in writes:
            for page in pages:
                owner = self._owner.get(page)
                if owner is not req:
                    raise PageOwnershipError(
                        f"batch {number} writes page {page} for {_party(req)}, but "
                        f"{'nobody' if owner is None else _party(owner)} owns it"
                    )
        for req, _ in writes:
            self._in_flight.setdefault(req, []).append(number)

    def settle(self, number: int, reqs: Collection[Request]) -> None:
        """Batch ``number``'s results were processed."""
        for req in reqs:
            if number not in self._in_flight.get(req, ()):
                raise PageOwnershipError(f"batch {number} was not in flight for {_party(req)}")
        for req in reqs:
            batches = self._in_flight[req]
            batches.remove(number)
            if not batches:
                del self._in_flight[req]

    # -- idle ---------------------------------------------------------------------------------
    def check_idle(self, free: Collection[int], cached: Collection[int]) -> None:
        """With nothing scheduled: every page is free or cached, nobody holds or has a
        batch in flight, and ``free`` (the pool's free pages) and ``cached`` (the
        cache's pages) are exactly the ledger's."""
        private = {p: o for p, o in self._owner.items() if o != CACHE}
        if private:
            page, owner = min(private.items())
            raise PageOwnershipError(
                f"idle, yet {len(private)} pages are still private (page {page}: {_party(owner)})"
            )
        if self._holders:
            page = min(self._holders)
            names = ", ".join(sorted(_party(r) for r in self._holders[page]))
            raise PageOwnershipError(f"idle, yet page {page} is still held by {names}")
        if self._in_flight:
            req = next(iter(self._in_flight))
            raise PageOwnershipError(f"idle, yet {_party(req)} has batches in flight")
        mine = set(self._owner)
        if set(cached) != mine:
            raise PageOwnershipError(
                f"the radix cache holds pages {sorted(set(cached) ^ mine)[:8]} the ledger "
                "does not give it (or the reverse)"
            )
        expected_free = set(range(1, self.num_pages)) - mine
        if set(free) != expected_free or len(free) != len(expected_free):
            raise PageOwnershipError(
                "the pool's free list disagrees with the ledger: "
                f"{sorted(set(free) ^ expected_free)[:8]}"
            )

    # -- helpers --------------------------------------------------------------------------------
    def _check_page(self, page: int) -> None:
        if not 1 <= page < self.num_pages:
            raise PageOwnershipError(f"page {page} is not a KV page (1..{self.num_pages - 1})")

    def _check_owner(self, page: int, party: Request | str, action: str) -> None:
        owner = self._owner.get(page)
        if owner is not party:
            who = "nobody (it is free)" if owner is None else _party(owner)
            raise PageOwnershipError(f"page {page} {action} by {_party(party)}, but {who} owns it")

    def _check_not_in_flight(self, req: Request, page: int, action: str) -> None:
        batches = self._in_flight.get(req)
        if batches:
            raise PageOwnershipError(
                f"page {page} {action} by {_party(req)} while batch {batches[0]} "
                "in flight still uses it"
            )


def _distinct(pages: Collection[int], action: str) -> None:
    if len(set(pages)) != len(pages):
        raise PageOwnershipError(f"a page appears twice among the pages {action}: {sorted(pages)}")
