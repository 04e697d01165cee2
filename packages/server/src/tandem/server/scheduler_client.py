"""The API process's handle on the scheduler process: launch, requests, liveness.

One receiver task reads every message from the scheduler and routes it to the queue of
the request it belongs to. A watchdog polls the process: the moment it is gone, every
open request gets an error and new ones are refused, so no client ever waits on a
scheduler that no longer exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tandem.scheduler.tokenizer import Tokenizer
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
class _Open:
    chunks: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)


class SchedulerClient:
    """Starts the scheduler process and talks to it over ZMQ."""

    def __init__(self, engine_kwargs: dict[str, Any], startup_timeout_s: float = 600.0) -> None:
        self.engine_kwargs = engine_kwargs
        self.startup_timeout_s = startup_timeout_s
        self.info: dict[str, Any] = {}
        # The API process's own tokenizer: it turns the token ids the scheduler sends
        # into the streamed text (loaded once the engine reports its model path).
        self.tokenizer: Tokenizer | None = None
        self.alive = False
        self._open: dict[str, _Open] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._dir = tempfile.mkdtemp(prefix="tandem-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self.finished_listeners: list[Any] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

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
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        """Stop the scheduler (politely, then by force) and release everything."""
        self._closing = True
        self._fail_all("the server is shutting down")
        proc = self._proc
        if proc is not None and proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send(protocol.encode({"type": protocol.STOP}))
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.terminate()
                await asyncio.to_thread(proc.join, 5)
            if proc.is_alive():
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

    # -- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        params: dict[str, Any],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's chunks; the last has ``meta["finish_reason"]``.

        Leaving the iteration early (a client that went away) aborts the request.
        """
        if not self.alive:
            raise SchedulerUnavailable("the scheduler process is not running")
        rid = rid or uuid.uuid4().hex
        if rid in self._open:
            raise RequestFailed(f"rid {rid!r} is already in use", invalid=True)
        entry = _Open()
        self._open[rid] = entry
        finished = False
        try:
            await self._push.send(
                protocol.encode(
                    {
                        "type": protocol.ADD,
                        "rid": rid,
                        "input_ids": input_ids,
                        "params": params,
                        "return_logprob": return_logprob,
                        "top_logprobs_num": top_logprobs_num,
                    }
                )
            )
            while True:
                msg = await entry.chunks.get()
                if msg["type"] == protocol.ERROR:
                    finished = True
                    raise RequestFailed(msg["message"], bool(msg.get("invalid")))
                if msg["type"] == "dead":
                    finished = True
                    raise SchedulerUnavailable(msg["message"])
                yield msg
                if msg["meta"]["finish_reason"] is not None:
                    finished = True
                    return
        finally:
            self._open.pop(rid, None)
            if not finished and self.alive:
                with contextlib.suppress(zmq.ZMQError):
                    self._push.send(protocol.encode({"type": protocol.ABORT, "rid": rid}))

    # -- background tasks ----------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            msg = protocol.decode(await self._pull.recv())
            kind = msg.get("type")
            if kind == protocol.INFO:
                self.info = msg["info"]
                continue
            if kind == protocol.CHUNK and msg["meta"]["finish_reason"] is not None:
                for listener in self.finished_listeners:
                    listener(msg["meta"])
            entry = self._open.get(msg.get("rid", ""))
            if entry is not None:
                entry.chunks.put_nowait(msg)

    async def _watch(self) -> None:
        assert self._proc is not None
        while self._proc.is_alive():
            await asyncio.sleep(0.1)
        if not self._closing:
            log.error("the scheduler process died (exit code %s)", self._proc.exitcode)
        self.alive = False
        self._fail_all("the scheduler process died")

    def _fail_all(self, message: str) -> None:
        for entry in list(self._open.values()):
            entry.chunks.put_nowait({"type": "dead", "message": message})
