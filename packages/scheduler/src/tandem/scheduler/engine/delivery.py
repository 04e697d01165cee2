"""Result delivery: where the loop thread hands a request's results, and how callers
read them.

A ``Waiter`` queues chunks for one request; ``ChunkReader`` reads them back, as a sync
or an async iterator over the same rules (an error ends the stream with a
``RuntimeError``, the chunk carrying a ``finish_reason`` ends it normally), and
``collect`` joins a request's chunks into its final result. An ``Outbox`` instead takes
a whole step's news for many requests in one call (the server's scheduler process).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.scheduler.request import Request

Chunk = dict[str, Any]
"""What ``Engine.generate`` yields: SGLang's ``text``, ``output_ids`` and ``meta_info``."""


@dataclass(slots=True)
class Delta:
    """One request's news from one step, the one shape from the loop thread to the SSE
    frame: its new token ``ids``, only its new logprobs, and ``meta`` (``cached_tokens``;
    on the last delta also ``finish_reason``, the token counts and ``spec_verify_ct``).
    The loop thread has no text: whoever reads the ids decodes them once, into ``text``,
    and numbers the request's choice (``index``)."""

    rid: str
    ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    logprobs: list[list[Any]] = field(default_factory=list)  # [logprob, id] per new token
    top_logprobs: list[list[list[Any]]] = field(default_factory=list)  # pairs per token
    # Prompt logprobs, on the first delta when asked for: [logprob, id] pairs from
    # ``logprob_start_len`` on (the first prompt token's logprob None), and the top
    # alternatives per prompt position (None at the first).
    input_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None
    text: str = ""
    index: int = 0

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's word for how the request ended (``length`` or ``stop``), or None."""
        reason = self.meta.get("finish_reason")
        if reason is None:
            return None
        return "length" if reason.get("type") == "length" else "stop"

    def wire(self) -> list[Any]:
        """The delta as plain data for msgpack between processes: its fields up to the
        text, in order (an array, so no field name travels with every delta)."""
        return [
            self.rid, self.ids, self.meta, self.logprobs, self.top_logprobs,
            self.input_logprobs, self.input_top_logprobs,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, data: list[Any]) -> Delta:
        return cls(*data)


class Outbox(Protocol):
    """Takes a step's deltas for all its requests at once, on the loop thread."""

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
    sent_input_logprobs: bool = False
    """Prompt logprobs delivered through the outbox (they go once, all together)."""
    input_meta: dict[str, Any] | None = None
    """The prompt logprobs' ``meta_info`` entries, once complete (built once)."""

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


class ChunkReader:
    """A request's chunks, up to and including the one that finishes it: iterate it
    with ``for`` (a thread's waiter) or ``async for`` (an asyncio waiter); each chunk
    passes through ``transform`` when one is given."""

    def __init__(self, waiter: Waiter, transform: Callable[[Chunk], Chunk] | None = None) -> None:
        self._waiter = waiter
        self._done = False
        self._transform = transform

    def __iter__(self) -> ChunkReader:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        return self._accept(self._waiter.chunks.get())

    def __aiter__(self) -> ChunkReader:
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
        return item if self._transform is None else self._transform(item)


def collect(waiter: Waiter, transform: Callable[[Chunk], Chunk] | None = None) -> Chunk:
    """A request's final result: its chunks' text and ids joined, the last meta (passed
    through ``transform`` when one is given)."""
    text, ids, meta = "", [], None
    for chunk in ChunkReader(waiter):
        text += chunk["text"]
        ids.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
    result = {"text": text, "output_ids": ids, "meta_info": meta}
    return result if transform is None else transform(result)


LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
"""``meta_info``'s lists of ``(logprob, token_id, text)`` tuples."""
TOP_LOGPROB_KEYS = ("input_top_logprobs", "output_top_logprobs")
"""``meta_info``'s lists, per position, of such tuples (or ``None``)."""


def with_logprob_text(chunk: Chunk, text: Callable[[int], str]) -> Chunk:
    """``chunk`` with the text of each logprob tuple's token as its third element
    (SGLang's ``return_text_in_logprobs``); ``text`` decodes one token id."""
    meta = dict(chunk["meta_info"])
    for key in LOGPROB_KEYS:
        if key in meta:
            meta[key] = [(lp, tok, text(tok)) for lp, tok, _ in meta[key]]
    for key in TOP_LOGPROB_KEYS:
        if key in meta:
            meta[key] = [
                None if step is None else [(lp, tok, text(tok)) for lp, tok, _ in step]
                for step in meta[key]
            ]
    return {**chunk, "meta_info": meta}
