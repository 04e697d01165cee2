"""``tandem serve --dp-size N``: N engine replicas behind one API process.

The dispatcher's choice and bookkeeping against stand-in replicas; then a live server
with two replicas: concurrent greedy requests answered as the engine answers them, on
both replicas, and a killed replica that fails the whole server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import live_server, process_alive, stream_in_background

from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.models.tiny import default_model_path
from tandem.server.dp_client import (
    DIST_PORT_STRIDE,
    DataParallelClient,
    aggregate_info,
    replica_engine_kwargs,
    shortest_queue,
)
from tandem.server.front_door import public_info
from tandem.server.scheduler_client import RequestFailed, SchedulerUnavailable
from tandem.server.server_config import ServerConfig

KEY = "sk-dp"  # /get_server_info shows the replicas' pids only with the key
AUTH = {"Authorization": f"Bearer {KEY}"}
REQUESTS = 32
MAX_NEW = 8


# -- the dispatcher, against stand-in replicas -------------------------------------------------
class FakeReplica:
    """A replica whose jobs each finish when ``release`` is set."""

    def __init__(self) -> None:
        self.alive = False
        self.info: dict[str, Any] = {}
        self.tokenizer = None
        self.pid = 1
        self.on_hung: Any = None
        self.finished_listeners: list[Any] = []
        self.release = asyncio.Event()
        self.requests: list[list[str]] = []
        self.failed_with: list[str] = []
        self.flushes = 0
        self._queues: list[asyncio.Queue[BaseException | None]] = []

    @property
    def open_requests(self) -> int:
        return len(self._queues)

    async def start(self) -> None:
        self.alive = True

    async def close(self) -> None:
        self.alive = False

    async def flush_cache(self) -> bool:
        self.flushes += 1
        return True

    def fail_open(self, message: str) -> None:
        self.failed_with.append(message)
        for queue in self._queues:
            queue.put_nowait(SchedulerUnavailable(message))

    async def stream(self, jobs: list[dict[str, Any]]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        self.requests.append([job["rid"] for job in jobs])
        queue: asyncio.Queue[BaseException | None] = asyncio.Queue()
        self._queues.append(queue)
        try:
            waiter = asyncio.ensure_future(self.release.wait())
            failed = asyncio.ensure_future(queue.get())
            await asyncio.wait({waiter, failed}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if failed.done() and isinstance(failed.result(), BaseException):
                raise failed.result()  # type: ignore[misc]
            failed.cancel()
            for position, job in enumerate(jobs):
                meta = {"finish_reason": {"type": "length", "length": 1}}
                for listener in self.finished_listeners:
                    listener(meta)
                yield position, Delta(job["rid"], [7], meta)
        finally:
            self._queues.remove(queue)


def _jobs(name: str, count: int) -> list[dict[str, Any]]:
    return [{"rid": f"{name}-{i}", "input_ids": [1], "params": {}} for i in range(count)]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_shortest_queue_picks_the_least_loaded_lowest_index_on_ties() -> None:
    assert shortest_queue([0]) == 0
    assert shortest_queue([0, 0, 0]) == 0
    assert shortest_queue([3, 1, 1]) == 1
    assert shortest_queue([2, 5, 0]) == 2
    assert shortest_queue([4, 4, 3, 3]) == 2


def test_requests_go_whole_to_the_replica_with_fewest_open_jobs() -> None:
    async def main() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        dp = DataParallelClient(replicas)  # type: ignore[arg-type]
        finished: list[dict[str, Any]] = []
        dp.finished_listeners.append(finished.append)
        await dp.start()
        results: dict[str, list[int]] = {}

        async def run(name: str, count: int) -> None:
            results[name] = [p async for p, _ in dp.stream(_jobs(name, count))]

        tasks = []
        for name, count in (("a", 3), ("b", 1), ("c", 1), ("d", 2), ("e", 1)):
            tasks.append(asyncio.create_task(run(name, count)))
            await _settle()
        # a: tie, replica 0; b, c, d: replica 1 (1 < 3, 2 < 3); e: replica 0 (3 < 4).
        assert [[rids[0][0] for rids in r.requests] for r in replicas] == [
            ["a", "e"],
            ["b", "c", "d"],
        ]
        assert dp.loads == [4, 4]
        assert dp.open_requests == 5
        assert not await dp.flush_cache()  # only an idle server flushes
        with pytest.raises(RequestFailed, match="'a-0' is already in use"):
            await anext(dp.stream(_jobs("a", 2)))
        replicas[1].release.set()
        await asyncio.gather(*tasks[1:4])
        assert dp.loads == [4, 0]
        assert results["d"] == [0, 1]
        replicas[0].release.set()
        await asyncio.gather(*tasks)
        assert dp.loads == [0, 0]
        assert len(finished) == 8
        assert await dp.flush_cache()
        assert [r.flushes for r in replicas] == [1, 1]
        await dp.close()

    asyncio.run(main())


def test_a_dead_replica_fails_every_request_and_gives_up() -> None:
    async def main() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        reasons: list[str] = []
        dp = DataParallelClient(replicas, on_hung=reasons.append)  # type: ignore[arg-type]
        await dp.start()
        assert dp.alive
        on_zero = asyncio.create_task(anext(dp.stream(_jobs("a", 1))))
        await _settle()
        replicas[1].alive = False  # its process died
        with pytest.raises(SchedulerUnavailable, match="scheduler replica 1 of 2 died"):
            await asyncio.wait_for(on_zero, 5)
        assert reasons == ["scheduler replica 1 of 2 died"]
        assert replicas[0].failed_with == reasons
        assert not dp.alive
        assert dp.info == {}
        with pytest.raises(SchedulerUnavailable, match="scheduler replica 1 of 2 died"):
            await anext(dp.stream(_jobs("b", 1)))
        replicas[0].on_hung("no heartbeat for 301.0 s")  # a second failure changes nothing
        assert reasons == ["scheduler replica 1 of 2 died"]
        await dp.close()

    asyncio.run(main())


def test_a_hung_replica_is_named() -> None:
    async def main() -> None:
        replicas = [FakeReplica(), FakeReplica()]
        reasons: list[str] = []
        dp = DataParallelClient(replicas, on_hung=reasons.append)  # type: ignore[arg-type]
        await dp.start()
        replicas[0].on_hung("no heartbeat for 301.0 s")
        assert reasons == ["scheduler replica 0 of 2: no heartbeat for 301.0 s"]
        assert replicas[1].failed_with == reasons
        await dp.close()

    asyncio.run(main())


def test_replica_engine_kwargs() -> None:
    import torch

    cores = torch.get_num_threads()
    given = {"model_path": None, "dist_init_addr": "10.0.0.1:5000"}
    first = replica_engine_kwargs(given, 0, 2)
    assert first["cpu_forward_threads"] == max(1, cores // 2)
    assert first["dist_init_addr"] == "10.0.0.1:5000"
    assert (
        replica_engine_kwargs(given, 3, 4)["dist_init_addr"]
        == f"10.0.0.1:{5000 + 3 * DIST_PORT_STRIDE}"
    )
    assert replica_engine_kwargs({"cpu_forward_threads": 3}, 1, 2)["cpu_forward_threads"] == 3
    assert replica_engine_kwargs({}, 0, 1) == {}
    assert given == {"model_path": None, "dist_init_addr": "10.0.0.1:5000"}


def test_aggregate_info() -> None:
    infos = [
        {"device": "cpu", "forward_steps": 3, "num_running_requests": 1, "scheduler_pid": 11,
         "device_busy_s": 1.0, "device_idle_s": 1.0, "device_idle_fraction": 0.5},
        {"device": "cpu", "forward_steps": 4, "num_running_requests": 0, "scheduler_pid": 12,
         "device_busy_s": 3.0, "device_idle_s": 0.0, "device_idle_fraction": 0.0},
    ]  # fmt: skip
    info = aggregate_info(infos)
    assert info["forward_steps"] == 7
    assert info["num_running_requests"] == 1
    assert info["device_idle_fraction"] == 0.2  # 1 s idle of 5
    assert info["device"] == "cpu"
    assert info["dp_size"] == 2
    assert "scheduler_pid" not in info
    assert [r["scheduler_pid"] for r in info["replicas"]] == [11, 12]
    assert all("scheduler_pid" not in r for r in public_info(info)["replicas"])
    assert aggregate_info([infos[0], {}]) == {}


def test_dp_size_is_validated() -> None:
    with pytest.raises(ValueError, match="dp_size"):
        ServerConfig(dp_size=0).validate()


# -- a live server -----------------------------------------------------------------------------
def _prompts() -> list[str]:
    return [f"Prompt number {i}: " + "ab" * (i % 7) for i in range(REQUESTS)]


def _info(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/get_server_info", headers=AUTH, timeout=10).json()


def test_two_replicas_answer_as_the_engine_does(cache: Path) -> None:
    body = {"sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    with live_server(cache, "--dp-size", "2", "--api-key", KEY) as server:
        info = _info(server.url)
        assert info["dp_size"] == 2
        assert len(info["replicas"]) == 2
        import torch

        threads = max(1, torch.get_num_threads() // 2)  # the cores, shared by two replicas
        assert [r["forward_threads"] for r in info["replicas"]] == [threads, threads]

        async def main() -> list[list[int]]:
            limits = httpx.Limits(max_connections=REQUESTS)
            async with httpx.AsyncClient(
                base_url=server.url, headers=AUTH, timeout=60, limits=limits
            ) as client:

                async def one(text: str) -> list[int]:
                    response = await client.post("/generate", json={**body, "text": text})
                    assert response.status_code == 200, response.text
                    return list(response.json()["output_ids"])

                return await asyncio.gather(*(one(p) for p in _prompts()))

        outputs = asyncio.run(main())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = _info(server.url)
            if info["finished_requests"] == REQUESTS:
                break
            time.sleep(0.1)
        per_replica = [r["finished_requests"] for r in info["replicas"]]
        assert sum(per_replica) == REQUESTS
        assert min(per_replica) > 0, per_replica
        pids = [r["scheduler_pid"] for r in info["replicas"]]
        assert len(set(pids)) == 2
        loads = httpx.get(f"{server.url}/v1/loads", headers=AUTH, timeout=10).json()
        assert [load["dp_rank"] for load in loads["loads"]] == [0, 1]
        flushed = httpx.post(f"{server.url}/flush_cache", headers=AUTH, timeout=30)
        assert flushed.status_code == 200, flushed.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_alive(p) for p in pids)

    from tandem.scheduler import Engine

    model = default_model_path(cache)
    with Engine(model_path=str(model), device="cpu", cpu_forward_threads=threads) as engine:
        expected = engine.generate(_prompts(), dict(body["sampling_params"]))
    assert outputs == [out["output_ids"] for out in expected]


def test_a_killed_replica_fails_the_server(cache: Path) -> None:
    with live_server(cache, "--dp-size", "2", "--api-key", KEY) as server:
        pids = [r["scheduler_pid"] for r in _info(server.url)["replicas"]]
        reader, lines = stream_in_background(server.url, AUTH)
        time.sleep(1.0)
        # The stream runs on replica 0 (a tie goes to the lower index); replica 1 dies.
        os.kill(pids[1], signal.SIGKILL)
        reader.join(timeout=20)
        assert not reader.is_alive(), "the in-flight stream hung"
        errors = [line for line in lines if '"error"' in line]
        assert errors, lines[-3:]
        assert "scheduler replica 1 of 2 died" in errors[0]
        response = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
            headers=AUTH, timeout=10,
        )  # fmt: skip
        assert response.status_code == 503
        assert "scheduler replica 1 of 2 died" in response.json()["error"]["message"]
        assert server.proc.wait(timeout=30) == 1
        deadline = time.monotonic() + 10
        while process_alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(pids[0])
        assert "scheduler replica 1 of 2 died" in server.stderr()
