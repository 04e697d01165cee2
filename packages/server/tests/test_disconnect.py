"""``until_disconnect`` closes its source (which aborts the jobs) however the client goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio

from tandem.server.generation import until_disconnect


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
