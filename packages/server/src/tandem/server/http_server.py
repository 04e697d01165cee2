"""``tandem serve``'s uvicorn server: the ready line, the drain, the watchdog's exit.

uvicorn alone stops listening on the first signal and cuts open streams after a fixed
grace. This server keeps listening and answers new requests 503 (so a load balancer
sees the drain), lets open requests finish for ``graceful_shutdown_timeout``, then ends
the rest with an in-band error and ``[DONE]`` before uvicorn's own shutdown runs. A
second SIGINT exits at once. A signal while the engine is still starting abandons the
start (``Lifecycle.stop_starting``) and stops through the normal shutdown, so nothing
is cancelled mid-way and nothing prints a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from tandem.server.lifecycle import Lifecycle
from tandem.server.scheduler_client import SchedulerClient

log = logging.getLogger(__name__)

# What uvicorn still waits for once the drain is over (responses already ending).
CLOSE_GRACE_S = 5.0
# How long a server whose scheduler hung keeps answering 503 (to /health too) before it
# exits, so that a probe or a load balancer sees why it is leaving.
HUNG_LINGER_S = 2.0


class TandemServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        on_started: Callable[[str], str],
        lifecycle: Lifecycle,
        client: Callable[[], SchedulerClient | None],
        grace_s: float,
    ) -> None:
        super().__init__(config)
        # Called with the URL once the server listens; returns the ready line to print
        # (``app.started``, which also freezes the process's heap).
        self.on_started = on_started
        self.lifecycle = lifecycle
        self.client = client
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        lifecycle.request_exit = self._exit_soon

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        # The loop is known before uvicorn takes the signals, so a signal while it
        # loads the app abandons the start like one during the engine's start.
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            print(self.on_started(self.url()), file=sys.stderr, flush=True)

    def url(self) -> str:
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would stop listening at once and re-raise the signal after.
        if not self.started:
            if self.should_exit or self._loop is None:
                self.force_exit = True
            elif not self.lifecycle.stop_starting.is_set():
                print("stopping: the engine's start is abandoned", file=sys.stderr, flush=True)
                loop = self._loop
                loop.call_soon_threadsafe(self.lifecycle.stop_starting.set)
            self.should_exit = True
            return
        if self.lifecycle.draining or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self.lifecycle.draining = True
        print("draining: new requests get 503", file=sys.stderr, flush=True)
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        client = self.client()
        while client is not None and client.open_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if client is not None and client.open_requests:
            log.warning(
                "%d requests still open after %.0f s: ending them",
                client.open_requests, self.grace_s,
            )  # fmt: skip
            client.fail_open("the server is shutting down")
            await asyncio.sleep(0.2)  # let the streams write their last event
        self.should_exit = True

    def _exit_soon(self) -> None:
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_later(HUNG_LINGER_S, setattr, self, "should_exit", True)
