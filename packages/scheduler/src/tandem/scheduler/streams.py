"""Result streams: where the loop thread delivers a request's chunks, and how callers
read them.

A ``Waiter`` queues chunks for one request; ``ChunkStream`` reads them back, as a sync
or an async iterator over the same rules (an error ends the stream with a
``RuntimeError``, the chunk carrying a ``finish_reason`` ends it normally), and
``collect`` joins a request's chunks into its final result. An ``Outbox`` instead takes
a whole step's news for many requests in one call (the server's scheduler process).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.scheduler.request import Request

Chunk = dict[str, Any]
Delta = dict[str, Any]


class Outbox(Protocol):
    """Takes a step's deltas for all its requests at once, on the loop thread.

    A delta holds a request's ``rid``, its new token ``ids``, only its new logprobs
    (``logprobs``: ``[logprob, id]`` pairs; ``top_logprobs``: a list of those pairs per
    token) and ``meta`` (``cached_tokens``; on the last delta also ``finish_reason``,
    the token counts and ``spec_verify_ct``). No text: whoever reads the ids decodes
    them, once."""

    def send(self, deltas: list[Delta]) -> None: ...

    def fail(self, rid: str, error: BaseException) -> None:
        """The request ``rid`` ends with ``error`` (the engine stopped or failed)."""


@dataclass
class Waiter:
    """Where the loop thread delivers a request's chunks.

    A stream gets a chunk per step; any other request only its final result, so a
    batch call adds no per-token work to the loop thread, which runs beside the
    forward. An asyncio stream (``loop`` set) is fed through the loop itself rather
    than through a thread hop per chunk."""

    req: Request
    stream: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    outbox: Outbox | None = None
    """Set: the request's deltas go to this outbox, with its step's others."""
    chunks: queue.Queue[Chunk | BaseException] = field(default_factory=queue.Queue)
    achunks: asyncio.Queue[Chunk | BaseException] | None = None
    sent_logprobs: int = 0
    """Logprobs already delivered through the outbox."""

    def __post_init__(self) -> None:
        if self.loop is not None:
            self.achunks = asyncio.Queue()

    def put(self, item: Chunk | BaseException) -> None:
        """Hand ``item`` to the consumer (called on the loop thread)."""
        if self.outbox is not None:
            assert isinstance(item, BaseException), "deltas go through EngineLoop._deliver"
            self.outbox.fail(self.req.rid, item)
            return
        if self.loop is None:
            self.chunks.put(item)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read
            self.loop.call_soon_threadsafe(put_all, [(self, item)])


def put_all(items: Sequence[tuple[Waiter, Chunk | BaseException]]) -> None:
    """On an asyncio loop: queue chunks (a step's, or an error) for their streams."""
    for waiter, item in items:
        assert waiter.achunks is not None
        waiter.achunks.put_nowait(item)


class ChunkStream:
    """A request's chunks, up to and including the one that finishes it: iterate it
    with ``for`` (a thread's waiter) or ``async for`` (an asyncio waiter)."""

    def __init__(self, waiter: Waiter) -> None:
        self._waiter = waiter
        self._done = False

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        return self._accept(self._waiter.chunks.get())

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        assert self._waiter.achunks is not None
        return self._accept(await self._waiter.achunks.get())

    def _accept(self, item: Chunk | BaseException) -> Chunk:
        if isinstance(item, BaseException):
            self._done = True
            raise RuntimeError("generation failed") from item
        self._done = item["meta_info"]["finish_reason"] is not None
        return item


def collect(waiter: Waiter) -> Chunk:
    """A request's final result: its chunks' text and ids joined, the last meta."""
    text, ids, meta = "", [], None
    for chunk in ChunkStream(waiter):
        text += chunk["text"]
        ids.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
    return {"text": text, "output_ids": ids, "meta_info": meta}
