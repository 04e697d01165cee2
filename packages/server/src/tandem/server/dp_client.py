"""Data parallelism on one machine (``tandem serve --dp-size N``).

N scheduler processes, each a full engine replica behind a ``SchedulerClient`` of its
own, serve one API process. Each HTTP request goes whole (all its prompts and choices)
to the replica with the fewest open jobs; a tie goes to the lowest index. The app sees
one client with ``SchedulerClient``'s interface.

There is no partial service: once a replica dies or its client gives up on it, every
open request fails with a 503 naming the replica, new ones are refused, and the server
exits non-zero (``on_hung``), as it does when its single scheduler hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server.scheduler_client import RequestFailed, SchedulerClient, SchedulerUnavailable

log = logging.getLogger(__name__)

DIST_PORT_STRIDE = 100
"""Replica i's ``dist_init_addr`` port is the given one plus ``i`` times this, leaving
each replica's ranks room for ports of their own above their base."""

_WATCH_PERIOD_S = 0.1

# Figures of ``get_server_info`` that add up over replicas; the rest (the configuration,
# the model's facts) are the same in every replica and are shown once.
_SUMMED = frozenset(
    {f.name for f in dataclasses.fields(Counters)}
    | {
        "num_running_requests",
        "num_waiting_requests",
        "max_total_tokens",
        "available_kv_tokens",
        "cached_kv_tokens",
        "free_rows",
        "device_busy_s",
        "device_idle_s",
    }
)


def replica_engine_kwargs(
    engine_kwargs: dict[str, Any], index: int, dp_size: int
) -> dict[str, Any]:
    """The engine options of replica ``index`` of ``dp_size``: the server's, adjusted so
    that the replicas share the machine instead of fighting over it."""
    kwargs = dict(engine_kwargs)
    if dp_size > 1 and not kwargs.get("cpu_forward_threads"):
        # The engine's default counts every core as its own (ignored off the CPU).
        import torch

        ranks = dp_size * int(kwargs.get("tp_size") or 1)  # every replica's every rank
        kwargs["cpu_forward_threads"] = max(1, torch.get_num_threads() // ranks)
    addr = kwargs.get("dist_init_addr")
    if addr and index:
        host, _, port = str(addr).rpartition(":")
        kwargs["dist_init_addr"] = f"{host}:{int(port) + index * DIST_PORT_STRIDE}"
    return kwargs


def shortest_queue(loads: Sequence[int]) -> int:
    """The index of the smallest load, the lowest index among equals."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def aggregate_info(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``get_server_info`` for all replicas: counters and pool figures summed, the
    rest from replica 0, each replica's own under ``replicas``. Empty while a replica
    has no figures (not started, or gone): stale figures are never reported as current."""
    if not infos or not all(infos):
        return {}
    out = {k: v for k, v in infos[0].items() if k != "scheduler_pid"}
    for key in _SUMMED & out.keys():
        out[key] = sum(info.get(key) or 0 for info in infos)
    if "device_idle_fraction" in out:
        total = out.get("device_busy_s", 0) + out.get("device_idle_s", 0)
        out["device_idle_fraction"] = out.get("device_idle_s", 0) / total if total > 0 else 0.0
    if "avg_spec_accept_length" in out:
        steps = out.get("spec_verify_steps") or 0
        out["avg_spec_accept_length"] = (
            (out.get("spec_committed_tokens") or 0) / steps if steps else 0.0
        )
    out["dp_size"] = len(infos)
    out["replicas"] = [dict(info) for info in infos]
    return out


class DataParallelClient:
    """N ``SchedulerClient`` replicas behind ``SchedulerClient``'s interface.

    It owns each replica's ``on_hung`` and listens to each one's finished requests. A
    replica that dies, or whose client gives up on it (hung, or a fatal engine error),
    fails the whole server (``_fail``).
    """

    def __init__(
        self,
        replicas: Sequence[SchedulerClient],
        on_hung: Callable[[str], None] | None = None,
    ) -> None:
        self.replicas = list(replicas)
        self.on_hung = on_hung
        """Called once, with the reason, when a replica dies or hangs."""
        self.finished_listeners: list[Callable[[dict[str, Any]], None]] = []
        self.failure: str | None = None
        """Why the replicas no longer serve (``None`` while they all do)."""
        self._load = [0] * len(self.replicas)
        """Each replica's jobs dispatched and not yet finished."""
        self._rids: set[str] = set()
        self._closing = False
        self._started = False
        self._monitor: asyncio.Task[None] | None = None
        for index, replica in enumerate(self.replicas):
            replica.on_hung = functools.partial(self._replica_hung, index)
            replica.finished_listeners.append(self._finished)

    @classmethod
    def launch(
        cls,
        engine_kwargs: dict[str, Any],
        dp_size: int,
        watchdog_timeout_s: float = 300.0,
        on_hung: Callable[[str], None] | None = None,
    ) -> DataParallelClient:
        """``dp_size`` replicas of the engine ``engine_kwargs`` describes (not started)."""
        replicas = [
            SchedulerClient(
                replica_engine_kwargs(engine_kwargs, i, dp_size),
                watchdog_timeout_s=watchdog_timeout_s,
            )
            for i in range(dp_size)
        ]
        return cls(replicas, on_hung)

    # -- SchedulerClient's interface -----------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._started and self.failure is None and all(r.alive for r in self.replicas)

    @property
    def info(self) -> dict[str, Any]:
        if self.failure is not None:
            return {}
        return aggregate_info([r.info for r in self.replicas])

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.replicas[0].tokenizer

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    @property
    def open_requests(self) -> int:
        return sum(r.open_requests for r in self.replicas)

    @property
    def loads(self) -> list[int]:
        """Each replica's open jobs (what the dispatcher compares)."""
        return list(self._load)

    async def start(self) -> None:
        """Start every replica at once; return when all are ready, or raise the first
        failure (naming the replica) once the others are stopped starting."""
        tasks = [asyncio.ensure_future(r.start()) for r in self.replicas]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for index, task in enumerate(tasks):
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError(
                    f"{self._name(index)} failed to start: {task.exception()}"
                ) from task.exception()
        self._started = True
        self._monitor = asyncio.create_task(self._watch())

    async def close(self) -> None:
        self._closing = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await asyncio.gather(*(r.close() for r in self.replicas))

    def fail_open(self, message: str) -> None:
        for replica in self.replicas:
            replica.fail_open(message)

    async def stream(self, jobs: list[dict[str, Any]]) -> AsyncIterator[tuple[int, Delta]]:
        """``SchedulerClient.stream`` on the replica with the fewest open jobs."""
        if not self.alive:
            self._check_replicas()
            raise SchedulerUnavailable(self.failure or "the scheduler processes are not running")
        rids = [job["rid"] for job in jobs]
        busy = [rid for rid in rids if rid in self._rids]
        if busy:
            raise RequestFailed(f"rid {busy[0]!r} is already in use", invalid=True)
        index = shortest_queue(self._load)
        mine = set(rids)
        self._rids |= mine
        self._load[index] += len(jobs)
        running = len(jobs)
        try:
            async with contextlib.aclosing(self.replicas[index].stream(jobs)) as deltas:
                async for position, delta in deltas:
                    if delta.meta.get("finish_reason") is not None:
                        running -= 1
                        self._load[index] -= 1
                    yield position, delta
        except SchedulerUnavailable:
            self._check_replicas()
            if self.failure is None:
                raise
            raise SchedulerUnavailable(self.failure) from None
        finally:
            self._load[index] -= running
            self._rids -= mine

    async def flush_cache(self) -> bool:
        """Empty every replica's radix cache; ``False`` while a request is open (the
        replicas that were idle may have flushed meanwhile, which is harmless)."""
        if not self.alive:
            self._check_replicas()
            raise SchedulerUnavailable(self.failure or "the scheduler processes are not running")
        if self.open_requests:
            return False
        flushed = await asyncio.gather(*(r.flush_cache() for r in self.replicas))
        return all(flushed)

    # -- failures ------------------------------------------------------------------------------
    def _name(self, index: int) -> str:
        return f"scheduler replica {index} of {len(self.replicas)}"

    def _finished(self, meta: dict[str, Any]) -> None:
        for listener in self.finished_listeners:
            listener(meta)

    def _replica_hung(self, index: int, reason: str) -> None:
        self._fail(f"{self._name(index)}: {reason}")

    def _check_replicas(self) -> None:
        if self.failure is not None or self._closing or not self._started:
            return
        for index, replica in enumerate(self.replicas):
            if not replica.alive:
                log.error("%s died (pid %s)", self._name(index), replica.pid)
                self._fail(f"{self._name(index)} died")
                return

    def _fail(self, message: str) -> None:
        """Refuse everything from now on, end every open request with ``message``, and
        give up on the server."""
        if self.failure is not None or self._closing or not self._started:
            return
        self.failure = message
        log.error("%s: failing every request and stopping the server", message)
        self.fail_open(message)
        if self.on_hung is not None:
            self.on_hung(message)

    async def _watch(self) -> None:
        while self.failure is None:
            await asyncio.sleep(_WATCH_PERIOD_S)
            self._check_replicas()
