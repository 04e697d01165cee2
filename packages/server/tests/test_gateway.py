"""``tandem serve`` replicas behind the SGLang Model Gateway (``smg``).

In process, against a stand-in scheduler client: the routes a gateway reads
(``/get_model_info``, ``/v1/loads``, ``/flush_cache``) and their front door. Then, in one
test (one set of processes, even under pytest-xdist), two live CPU workers behind ``smg
launch --policy cache_aware`` (``fleet`` of tools/gateway_bench.py, every process stopped
at the end): the gateway takes them for SGLang workers, answers a burst of 64 concurrent
requests with both of them, sends requests that share a long prefix to one worker, where
its radix cache serves the prefix, and fans ``/flush_cache`` out to both.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import FLEET_START_S, ROOT, load_module
from server_process import call_asgi, share_kernels

from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server.errors import install_handlers
from tandem.server.front_door import install_front_door
from tandem.server.lifecycle import Lifecycle
from tandem.server.routes import gateway
from tandem.server.scheduler_client import SchedulerUnavailable
from tandem.server.server_config import ServerConfig

bench = load_module(ROOT / "tools" / "gateway_bench.py", "gateway_bench_under_test")
KEY = "sk-gateway-test"
INFO = {
    "model_path": "/srv/models/llama",
    "architecture": "LlamaForCausalLM",
    "max_total_tokens": 1000,
    "available_kv_tokens": 600,
    "cached_kv_tokens": 100,
    "num_running_requests": 3,
    "num_waiting_requests": 2,
    "max_running_requests": 64,
    "prompt_tokens": 400,
    "cached_tokens": 100,
    "generated_tokens": 0,
    "device_busy_s": 0.0,
}


class StandIn:
    """The scheduler client's part the gateway routes use."""

    def __init__(self, info: dict[str, Any], flushed: bool | BaseException = True) -> None:
        self.info = info
        self.flushed = flushed

    async def flush_cache(self) -> bool:
        if isinstance(self.flushed, BaseException):
            raise self.flushed
        return self.flushed


def gateway_app(client: StandIn, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI()
    install_handlers(app)
    install_front_door(app, config, Lifecycle())
    gateway.install(app, client, {"tokenizer_path": None}, timeout_s=5)
    return app


def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return call_asgi(app, method, path, **kwargs)


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


# -- in process --------------------------------------------------------------------------------
def test_model_info_shows_paths_only_with_the_key() -> None:
    client = StandIn(INFO)
    public = call(gateway_app(client), "GET", "/get_model_info").json()
    assert public["is_generation"] is True
    assert public["architectures"] == ["LlamaForCausalLM"]
    assert "model_path" not in public
    assert "tokenizer_path" not in public
    keyed = gateway_app(client, ServerConfig(api_key=KEY))
    auth = {"Authorization": f"Bearer {KEY}"}
    full = call(keyed, "GET", "/model_info", headers=auth).json()
    assert full["model_path"] == full["tokenizer_path"] == "/srv/models/llama"
    assert call(keyed, "GET", "/get_model_info").status_code == 401


def test_loads_in_sglang_shape() -> None:
    app = gateway_app(StandIn(INFO))
    body = call(app, "GET", "/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert body["dp_rank_count"] == 1
    (load,) = body["loads"]
    assert load == {
        "dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_total_reqs": 5,
        "num_used_tokens": 300, "max_total_num_tokens": 1000, "token_usage": 0.3,
        "gen_throughput": 0.0, "cache_hit_rate": 0.25, "utilization": 0.0,
        "max_running_requests": 64,
    }  # fmt: skip
    assert body["aggregate"]["total_reqs"] == 5
    for bad in ({"include": "everything"}, {"dp_rank": "-1"}):
        assert_error(call(app, "GET", "/v1/loads", params=bad), 400)


def test_loads_has_one_entry_per_data_parallel_replica() -> None:
    replicas = [INFO, {**INFO, "num_running_requests": 0, "num_waiting_requests": 0}]
    app = gateway_app(StandIn({**INFO, "replicas": replicas}))
    body = call(app, "GET", "/v1/loads").json()
    assert [load["dp_rank"] for load in body["loads"]] == [0, 1]
    assert [load["num_total_reqs"] for load in body["loads"]] == [5, 0]
    only = call(app, "GET", "/v1/loads", params={"dp_rank": 1}).json()
    assert [load["dp_rank"] for load in only["loads"]] == [1]


def test_load_rates_are_measured_between_reports() -> None:
    report = gateway.LoadReport()
    assert report.render(INFO)["loads"][0]["gen_throughput"] == 0.0
    report._marks[0] = (time.monotonic() - 2.0, 0.0, 0.0)  # as if reported 2 s ago
    load = report.render({**INFO, "generated_tokens": 100, "device_busy_s": 1.0})["loads"][0]
    assert load["gen_throughput"] == pytest.approx(50, rel=0.05)
    assert load["utilization"] == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize(
    ("flushed", "status", "words"),
    [
        (True, 200, ()),
        (False, 400, ("queued or running",)),
        (SchedulerUnavailable("the scheduler process died"), 503, ("died",)),
    ],
)
def test_flush_cache_answers(flushed: bool | BaseException, status: int, words: tuple[str]) -> None:
    response = call(gateway_app(StandIn(INFO, flushed)), "POST", "/flush_cache")
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json()["status"] == "ok"
    else:
        error = response.json()["error"]
        assert all(word in error["message"] for word in words)
        assert error["code"] == ("server_busy" if status == 400 else None)


def test_flush_cache_takes_no_body_and_refuses_one_that_is_not_json() -> None:
    app = gateway_app(StandIn(INFO))
    # smg sends the POST without a body or a content type
    assert call(app, "POST", "/flush_cache", headers={"Content-Length": "0"}).status_code == 200
    text = {"Content-Type": "text/plain"}
    assert_error(call(app, "POST", "/flush_cache", content=b"x", headers=text), 415)
    assert call(app, "GET", "/flush_cache").status_code == 405


# -- two workers behind smg --------------------------------------------------------------------
def test_two_workers_behind_smg(tmp_path: Path) -> None:
    if importlib.util.find_spec("smg") is None:
        pytest.fail("needs the SGLang Model Gateway: pip install smg (a test dependency)")
    default_model_path(tmp_path)  # built once here, not by both workers at once
    share_kernels(tmp_path)
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path), "TANDEM_DEBUG_FUTURES": "1"}
    workers = ["--model-path", "tandem-tiny", "--cpu-forward-threads", "1"]
    with bench.fleet(2, env=env, worker_args=workers, timeout_s=FLEET_START_S) as f:
        _discovered_as_sglang(f)
        _burst_uses_both_workers(f)
        _shared_prefix_goes_to_one_worker(f, tmp_path)
        _flush_reaches_every_worker(f)
    for started in f.processes:  # each in a process group of its own: none is left
        assert started.proc.returncode is not None
        assert _group_ends(started.proc.pid), started.name


def _group_ends(pgid: int, timeout_s: float = 10.0) -> bool:
    """Whether every process of group ``pgid`` is gone within ``timeout_s``. The group
    was sent SIGKILL, which none can survive, but a member may still be tearing down
    its memory (a model's worth) when its leader has been reaped; one still running
    after that long was not killed."""
    deadline = time.monotonic() + timeout_s
    while _running_in_group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _running_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` still running: a zombie (dead, waiting for an init
    that may never reap it, as in some containers) does not count."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def _counters(fleet: Any) -> list[dict[str, int]]:
    return [bench.served(url) for url in fleet.worker_urls]


def _discovered_as_sglang(fleet: Any) -> None:
    workers = httpx.get(f"{fleet.url}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.worker_urls)
    for worker in workers:
        assert worker["runtime_type"] == "sglang", worker  # found by /server_info
        assert worker["status"] == "ready", worker
        assert worker["labels"]["served_model_name"] == "tandem-tiny", worker
        assert worker["labels"]["model_type"] == "llama", worker  # from /model_info
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tandem-tiny"]


def _burst_uses_both_workers(fleet: Any) -> None:
    before = _counters(fleet)
    client = openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> str | None:
        # Different from the first characters on: no shared prefix pins them to a worker.
        out = await client.completions.create(
            model="tandem-tiny", prompt=f"{i:02d} burst request number {i}", max_tokens=8,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].finish_reason

    async def main() -> list[str | None]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 60)
        finally:
            await client.close()

    assert asyncio.run(main()) == ["length"] * 64
    deltas = bench.served_since(fleet.worker_urls, before)
    assert sum(d["finished_requests"] for d in deltas) == 64, deltas
    assert all(d["finished_requests"] > 0 for d in deltas), deltas


def _shared_prefix_goes_to_one_worker(fleet: Any, cache: Path) -> None:
    prefix = " ".join(f"Rule {i}: answer briefly and in plain words." for i in range(20))
    prefix_tokens = len(Tokenizer.from_pretrained(default_model_path(cache)).encode(prefix))
    before = _counters(fleet)
    cached = []
    for i in range(8):
        body = {"text": f"{prefix} Question {i}?", "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(f"{fleet.url}/generate", json=body, timeout=30)
        assert response.status_code == 200, response.text
        cached.append(response.json()["meta_info"]["cached_tokens"])
    deltas = bench.served_since(fleet.worker_urls, before)
    assert sorted(d["finished_requests"] for d in deltas) == [0, 8], deltas
    # After the first, each request found the prefix in that worker's radix cache.
    assert all(c >= prefix_tokens - 2 for c in cached[1:]), (prefix_tokens, cached)
    served = max(deltas, key=lambda d: d["finished_requests"])
    assert served["cached_tokens"] >= 7 * (prefix_tokens - 2), (prefix_tokens, served)


def _flush_reaches_every_worker(fleet: Any) -> None:
    response = httpx.post(f"{fleet.url}/flush_cache", timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["workers_flushed"] == 2
    deadline = time.monotonic() + 10
    for url in fleet.worker_urls:
        while httpx.get(f"{url}/get_server_info", timeout=10).json()["cached_kv_tokens"]:
            assert time.monotonic() < deadline, f"{url}: its radix cache was not emptied"
            time.sleep(0.1)


def test_the_script_benchmarks_through_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    default_model_path(tmp_path)
    share_kernels(tmp_path)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # the workers' environment
    tiny = ["--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "4"]
    assert bench.main(["--timeout", str(FLEET_START_S), "--", *tiny]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Successful requests\s+8\n", out), out
    served = [int(n) for n in re.findall(r"^http://127\.0\.0\.1:\d+: (\d+) requests", out, re.M)]
    assert len(served) == 2, out
    assert sum(served) == 8, out
