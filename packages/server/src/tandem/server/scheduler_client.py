"""The API process's handle on the scheduler process: launch, requests, liveness.

One receiver task reads every message from the scheduler (a step's deltas for many
requests at once) and routes each delta to the HTTP request it belongs to. A watchdog
polls the process: if it is gone, or hung (no heartbeat, or no step while work is
pending, for ``watchdog_timeout``), every open request gets an error and new ones are
refused, so no client ever waits on a scheduler that will not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server import protocol, scheduler_process

log = logging.getLogger(__name__)


class SchedulerUnavailable(RuntimeError):
    """The scheduler process is not running (dead, or shutting down)."""


class RequestFailed(RuntimeError):
    """The scheduler rejected (``invalid``) or failed a request."""

    def __init__(self, message: str, invalid: bool) -> None:
        super().__init__(message)
        self.invalid = invalid


@dataclass
class _Ticket:
    """One HTTP request's jobs: their deltas, merged in arrival order."""

    positions: dict[str, int]
    """Each job's rid -> its position in the request."""
    deltas: asyncio.Queue[tuple[int, Delta] | BaseException] = field(default_factory=asyncio.Queue)


class SchedulerClient:
    """Starts the scheduler process and talks to it over ZMQ."""

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        startup_timeout_s: float = 600.0,
        watchdog_timeout_s: float = 300.0,
        on_hung: Callable[[str], None] | None = None,
    ) -> None:
        self.engine_kwargs = engine_kwargs
        self.startup_timeout_s = startup_timeout_s
        self.watchdog_timeout_s = watchdog_timeout_s
        self.on_hung = on_hung
        """Called once, with the reason, when the watchdog gives up on the scheduler."""
        self.info: dict[str, Any] = {}
        """The engine's latest figures (empty once the scheduler is gone)."""
        # The API process's own tokenizer: it turns the token ids the scheduler sends
        # into the streamed text (loaded once the engine reports its model path).
        self.tokenizer: Tokenizer | None = None
        self.alive = False
        self._open: dict[str, _Ticket] = {}
        self._replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        """Answers awaited from the scheduler (``FLUSHED``), by the id the request carried."""
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._last_heard = self._last_progress = 0.0
        self._steps_seen: Any = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._dir = tempfile.mkdtemp(prefix="tandem-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self.finished_listeners: list[Callable[[dict[str, Any]], None]] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def open_requests(self) -> int:
        """HTTP requests with jobs in the scheduler."""
        return len(self._tickets())

    def _tickets(self) -> list[_Ticket]:
        """The open HTTP requests (``_open`` maps each of their rids to one)."""
        return list({id(t): t for t in self._open.values()}.values())

    async def start(self) -> None:
        """Spawn the scheduler and return once its engine is ready (or raise)."""
        in_addr = f"ipc://{os.path.join(self._dir, 'in')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'out')}"
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=scheduler_process.run,
            args=(self.engine_kwargs, in_addr, out_addr, os.getpid()),
            name="tandem-scheduler",
            daemon=True,
        )
        self._proc.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        while True:
            if not self._proc.is_alive():
                raise RuntimeError("the scheduler process exited during startup")
            if loop.time() > deadline:
                raise RuntimeError("the scheduler process did not become ready in time")
            if await self._pull.poll(200):
                msg = protocol.decode(await self._pull.recv())
                if msg["type"] == protocol.FATAL:
                    raise RuntimeError(f"the engine failed to start: {msg['message']}")
                if msg["type"] == protocol.READY:
                    self.info = msg["info"]
                    break
        path = Path(self.engine_kwargs.get("tokenizer_path") or self.info["model_path"])
        if (path / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_pretrained(path)
        self.alive = True
        self._last_heard = self._last_progress = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        """Stop the scheduler (politely, then by force) and release everything."""
        self._closing = True
        self._fail_all(SchedulerUnavailable("the server is shutting down"))
        proc = self._proc
        if proc is not None and proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send(protocol.encode({"type": protocol.STOP}))
            await asyncio.to_thread(proc.join, 15)
            if proc.is_alive():  # it ignores SIGTERM (see scheduler_process.run)
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self.alive = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def fail_open(self, message: str) -> None:
        """End every open request with ``SchedulerUnavailable(message)`` (a drain that
        ran out of time); their jobs are aborted as their iterators close."""
        self._fail_all(SchedulerUnavailable(message))

    # -- requests ------------------------------------------------------------------------------
    async def stream(self, jobs: list[dict[str, Any]]) -> AsyncIterator[tuple[int, Delta]]:
        """Run one HTTP request's jobs (``protocol.ADD`` entries, each with a fresh
        ``rid``); yield ``(position, delta)`` as deltas arrive until every job has its
        last one (``delta.meta["finish_reason"]`` set).

        Leaving the iteration early (a client that went away) aborts every job still
        running, in one message.
        """
        if not self.alive:
            raise SchedulerUnavailable("the scheduler process is not running")
        rids = [job["rid"] for job in jobs]
        busy = [rid for rid in rids if rid in self._open]
        if busy or len(set(rids)) != len(rids):
            raise RequestFailed(f"rid {(busy or rids)[0]!r} is already in use", invalid=True)
        ticket = _Ticket({rid: i for i, rid in enumerate(rids)})
        running = set(rids)
        for rid in rids:
            self._open[rid] = ticket
        try:
            await self._push.send(protocol.encode({"type": protocol.ADD, "jobs": jobs}))
            while running:
                item = await ticket.deltas.get()
                if isinstance(item, BaseException):
                    if isinstance(item, RequestFailed):
                        running.clear()  # the scheduler refused or ended them itself
                    raise item
                position, delta = item
                if delta.meta.get("finish_reason") is not None:
                    running.discard(delta.rid)
                yield position, delta
        finally:
            for rid in rids:
                self._open.pop(rid, None)
            if running and self.alive:
                with contextlib.suppress(zmq.ZMQError):
                    msg = {"type": protocol.ABORT, "rids": sorted(running)}
                    self._push.send(protocol.encode(msg))

    async def flush_cache(self) -> bool:
        """Empty the engine's radix cache; ``False`` (nothing changed) while a request is
        queued or running there (``Engine.flush_cache``)."""
        if not self.alive:
            raise SchedulerUnavailable("the scheduler process is not running")
        token = uuid.uuid4().hex
        reply = self._replies[token] = asyncio.get_running_loop().create_future()
        try:
            await self._push.send(protocol.encode({"type": protocol.FLUSH_CACHE, "id": token}))
            answer = await reply
        finally:
            self._replies.pop(token, None)
        if answer.get("error"):
            raise SchedulerUnavailable(str(answer["error"]))
        return bool(answer["flushed"])

    # -- background tasks ----------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            msg = protocol.decode(await self._pull.recv())
            self._last_heard = time.monotonic()
            kind = msg.get("type")
            if kind == protocol.INFO:
                self.info = msg["info"]
                steps = msg["info"].get("forward_steps")
                if steps != self._steps_seen:
                    self._steps_seen, self._last_progress = steps, self._last_heard
            elif kind == protocol.STEP:
                self._last_progress = self._last_heard
                for data in msg["out"]:
                    self._route(Delta.from_wire(data))
            elif kind == protocol.FATAL:  # the engine cannot go on (a rank exited)
                log.error("the scheduler failed: %s", msg["message"])
                self._gone(SchedulerUnavailable(f"the engine failed: {msg['message']}"))
                if self.on_hung is not None and not self._closing:
                    self.on_hung(msg["message"])
            elif kind == protocol.FLUSHED:
                reply = self._replies.get(msg["id"])
                if reply is not None and not reply.done():
                    reply.set_result(msg)
            elif kind == protocol.ERROR:
                error = RequestFailed(msg["message"], bool(msg.get("invalid")))
                # An error names the rids of one ADD, or one rid: one HTTP request.
                ticket = next((self._open[r] for r in msg["rids"] if r in self._open), None)
                if ticket is not None:
                    ticket.deltas.put_nowait(error)

    def _route(self, delta: Delta) -> None:
        meta = delta.meta
        if meta.get("finish_reason") is not None:
            for listener in self.finished_listeners:
                listener(meta)
        ticket = self._open.get(delta.rid)
        if ticket is not None:
            ticket.deltas.put_nowait((ticket.positions[delta.rid], delta))

    async def _watch(self) -> None:
        proc = self._proc
        assert proc is not None
        while proc.is_alive():
            await asyncio.sleep(0.1)
            reason = self._hung_reason(time.monotonic())
            if reason is not None and not self._closing:
                log.error("the scheduler is hung (%s): stopping it", reason)
                self._gone(SchedulerUnavailable(f"the scheduler is not responding ({reason})"))
                proc.kill()
                if self.on_hung is not None:
                    self.on_hung(reason)
                return
        if not self._closing:
            log.error("the scheduler process died (exit code %s)", proc.exitcode)
        self._gone(SchedulerUnavailable("the scheduler process died"))

    def _hung_reason(self, now: float) -> str | None:
        timeout = self.watchdog_timeout_s
        if now - self._last_heard > timeout:
            return f"no heartbeat for {now - self._last_heard:.1f} s"
        info = self.info
        pending = self._open or info.get("num_running_requests") or info.get("num_waiting_requests")
        if pending and now - self._last_progress > timeout:
            return f"no step for {now - self._last_progress:.1f} s with work pending"
        if not pending:
            self._last_progress = now
        return None

    def _gone(self, error: SchedulerUnavailable) -> None:
        self.alive = False
        self.info = {}
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for ticket in self._tickets():
            ticket.deltas.put_nowait(error)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error)
