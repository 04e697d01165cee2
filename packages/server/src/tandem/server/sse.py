"""Server-sent events, as both the OpenAI routes and ``/generate`` stream them.

Each payload is one ``data: {json}`` frame and the stream ends with ``data: [DONE]``.
An error once the stream has started can no longer change the status, so it goes
in-band: one frame with the error body, then ``[DONE]``. The stream stops, and closes
its source (which aborts the jobs behind it), as soon as the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.server.generation import as_api_error, cancel_and_wait, wait_disconnect

DONE = "data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def frames(payloads: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    """Each payload as a frame, then ``[DONE]``; a failure as the in-band error frame."""
    try:
        async with contextlib.aclosing(payloads) as source:
            async for payload in source:
                yield frame(payload)
    except Exception as exc:  # noqa: BLE001 - reported in-band, then the stream ends
        yield frame(as_api_error(exc).body()) + DONE
        return
    yield DONE


def response(request: Request, payloads: AsyncGenerator[dict[str, Any], None]) -> StreamingResponse:
    """The ``text/event-stream`` response of ``payloads``, until the client goes away."""
    return ClosingStreamingResponse(
        until_disconnect(request, frames(payloads)), media_type="text/event-stream"
    )


async def until_disconnect(request: Request, source: AsyncIterator[str]) -> AsyncIterator[str]:
    """Relay ``source`` until the client goes away, then close it (which aborts its jobs).

    uvicorn silently drops writes to a closed connection, and Starlette only listens for
    the disconnect on older ASGI versions, so a stream must watch for it itself. Newer
    Starlette versions instead cancel the response's task group on disconnect; the
    clean-up below is shielded from that cancellation and first stops the pending
    ``anext`` step, because closing a generator that is still running raises instead of
    aborting the jobs.
    """
    gone = asyncio.create_task(wait_disconnect(request))
    step: asyncio.Future[str] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(source))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            await cancel_and_wait(gone)
            if step is not None:
                await cancel_and_wait(step)
            await source.aclose()  # type: ignore[attr-defined]


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always closes its body iterator when it ends.

    When the client goes away, Starlette may cancel the response while the body
    generator sits suspended at a ``yield``; nothing then closes it until the garbage
    collector does, which can be never, so the jobs behind it would run to the end.
    Closing it here, shielded from the cancellation, runs its clean-up at once.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
