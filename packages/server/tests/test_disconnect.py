"""``until_disconnect`` closes its source (which aborts the jobs) however the client goes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import ClientDisconnect

from tandem.server.sse import ClosingStreamingResponse, until_disconnect


class FakeRequest:
    """Just enough of a Starlette request: ``receive`` returns a disconnect on demand."""

    def __init__(self) -> None:
        self.disconnect = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}


def _source(log: list[str], started: asyncio.Event) -> AsyncIterator[str]:
    async def gen() -> AsyncIterator[str]:
        try:
            yield "first"
            started.set()
            await asyncio.Event().wait()  # a job that never produces its next chunk
            yield "never"
        finally:
            log.append("closed")

    return gen()


def test_disconnect_message_closes_source() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        started = asyncio.Event()
        request = FakeRequest()
        got = []

        async def consume() -> None:
            async for item in until_disconnect(request, _source(log, started)):  # type: ignore[arg-type]
                got.append(item)

        task = asyncio.create_task(consume())
        await started.wait()
        request.disconnect.set()
        await asyncio.wait_for(task, 5)
        assert got == ["first"]
        return log

    assert asyncio.run(main()) == ["closed"]


def test_cancelled_response_task_still_closes_source() -> None:
    """Starlette cancels the response's task group on disconnect while ``anext`` runs."""

    async def main() -> list[str]:
        log: list[str] = []
        started = asyncio.Event()
        request = FakeRequest()
        stream = until_disconnect(request, _source(log, started))  # type: ignore[arg-type]
        with anyio.CancelScope() as scope:
            async for _ in stream:
                scope.cancel()
        await stream.aclose()  # type: ignore[attr-defined]
        return log

    assert asyncio.run(main()) == ["closed"]


def test_response_closes_a_body_left_suspended_at_a_yield() -> None:
    """The client is gone while the body generator waits at a ``yield``: the response
    ends with an error from ``send``, and the generator must still be closed."""

    async def main() -> list[str]:
        log: list[str] = []
        started = asyncio.Event()
        body = _source(log, started)  # held here, so no garbage collection closes it
        response = ClosingStreamingResponse(body)
        sent = 0

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal sent
            sent += 1
            if message["type"] == "http.response.body" and message.get("body"):
                raise OSError("connection reset by peer")

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET"}
        with contextlib.suppress(OSError, ClientDisconnect):
            await response(scope, receive, send)  # type: ignore[arg-type]
        closed_in_time = list(log)
        del body
        return closed_in_time

    assert asyncio.run(main()) == ["closed"]
