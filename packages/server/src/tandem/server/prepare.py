"""Request preparation off the event loop: parsing, chat templates and tokenizing.

These are CPU work of any length on a client's input; on the event loop they would hold
up every other request and ``/health``. ``Preparer`` runs them on a fixed number of
threads, and encoding goes through the tokenizer's batch call, which releases the GIL.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server.errors import APIError

T = TypeVar("T")

# Texts a tokenizer could shrink (normalizers that drop or merge characters); one that
# gives fewer tokens than length / longest token for any of them gets no length precheck.
_SAMPLES = (
    " " * 64, "\n" * 64, "\t" * 64, "\r\n" * 32, "\u3000" * 64, "\u200b" * 64, "\x00" * 64,
    "\ufeff" * 64, "e\u0301" * 32, "\ufb01" * 64,
)  # fmt: skip


class Preparer:
    """A bounded pool: at most ``workers`` requests are prepared at once, and at most
    ``queue_size`` more wait; past that a request is refused at once (503 with
    ``Retry-After``) rather than held in memory behind an unbounded queue."""

    def __init__(self, workers: int, queue_size: int = 512) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tandem-prepare")
        self.limit = workers + queue_size
        self.pending = 0  # submitted and not yet done; touched on the event loop only

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.pending >= self.limit:
            raise APIError(
                f"the server is preparing {self.pending} requests, its limit "
                "(--tokenizer-workers plus --prepare-queue-size); retry shortly",
                status=503,
                headers={"Retry-After": "1"},
            )
        loop = asyncio.get_running_loop()
        self.pending += 1
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def encode(tokenizer: Tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of each text (``Tokenizer.encode_batch``: without the GIL, so the event
    loop keeps going)."""
    return tokenizer.encode_batch(texts, add_special_tokens=special)


def max_token_chars(tokenizer: Tokenizer | None) -> int:
    """The most characters of text one token stands for: the longest decoded token, or
    raw vocabulary entry, whichever is longer. 0 when unknown (no tokenizer, or one that
    may shrink text: see ``_SAMPLES``)."""
    if tokenizer is None:
        return 0
    backend = tokenizer.backend
    decoded = backend.decode_batch(
        [[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False
    )
    raw = backend.get_vocab(with_added_tokens=True)
    longest = max([len(t) for t in decoded] + [len(t) for t in raw], default=0)
    if longest == 0:
        return 0
    for sample, ids in zip(_SAMPLES, encode(tokenizer, list(_SAMPLES), False), strict=True):
        if len(ids) * longest < len(sample):
            return 0
    return longest
