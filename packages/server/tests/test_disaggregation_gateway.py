"""Prefill/decode disaggregation behind the SGLang Model Gateway: three processes.

For each KV transfer backend (``mooncake``, ``torch``), one test runs ``pd_fleet`` of
tools/pd_bench.py: a prefill and a decode CPU ``tandem serve`` behind ``smg launch
--pd-disaggregation`` on loopback, every process stopped at the end. Through the gateway,
``/v1/completions``, ``/v1/chat/completions`` (the official ``openai`` client) and
``/generate``, streamed and not, then 16 concurrent requests, answer with the greedy text
the offline ``Engine`` gives for the same prompts, and both halves take part in each. A
decode server told of a prefill server that is not there answers with an error. Then
both servers are idle with every request row and KV page back (free or in the radix
cache, then all free once flushed), as before the requests.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import FLEET_START_S, ROOT, load_module
from server_process import share_kernels

from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.tokenizer import Tokenizer

pd_bench = load_module(ROOT / "tools" / "pd_bench.py", "pd_bench_under_test")
MAX_TOKENS = 12
SAMPLING = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
COMPLETIONS = [f"Story {i}: once upon a time" + " there was" * (i % 4) for i in range(8)]
CHATS = [f"Question {i}: name a colour" + "?" * (i % 3) for i in range(8)]
IDLE_KEYS = ("free_rows", "available_kv_tokens", "cached_kv_tokens", "max_total_tokens")
WAIT_S = 20.0


@pytest.fixture(scope="module")
def expected(cache: Path) -> dict[str, list[str]]:
    """The offline engine's greedy text for each prompt, from the token ids the server
    builds (chat: the template rendered, then encoded without special tokens)."""
    from tandem.scheduler import Engine

    model = default_model_path(cache)
    tokenizer = Tokenizer.from_pretrained(model)
    chat_ids = [
        tokenizer.backend.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            ),
            add_special_tokens=False,
        ).ids
        for text in CHATS
    ]
    with Engine(model_path=str(model), device="cpu", cpu_forward_threads=1) as engine:
        completions = engine.generate(COMPLETIONS, dict(SAMPLING))
        chats = engine.generate(
            input_ids=[list(ids) for ids in chat_ids], sampling_params=dict(SAMPLING)
        )
    return {"completions": [o["text"] for o in completions], "chat": [o["text"] for o in chats]}


@pytest.fixture
def fleet(request: pytest.FixtureRequest, cache: Path, tmp_path: Path) -> Iterator[Any]:
    backend = request.param
    if importlib.util.find_spec("smg") is None:
        pytest.fail("needs the SGLang Model Gateway: pip install smg (a test dependency)")
    if backend == "mooncake" and importlib.util.find_spec("mooncake") is None:
        pytest.fail("needs Mooncake: pip install mooncake-transfer-engine-non-cuda")
    default_model_path(cache)  # built before the servers start, not by both at once
    share_kernels(cache)
    env = {**os.environ, "TANDEM_CACHE_DIR": str(cache), "TANDEM_DEBUG_FUTURES": "1"}
    worker_args = ["--model-path", "tandem-tiny", "--cpu-forward-threads", "1"]
    worker_args += ["--disaggregation-timeout", "30"]
    with pd_bench.pd_fleet(
        backend, worker_args, env=env, timeout_s=FLEET_START_S, logs=tmp_path
    ) as running:
        yield running
    for started in running.processes:  # shown when the test fails
        sys.stderr.write(f"--- {started.name} ---\n{started.tail(40)}\n")
    for started in running.processes:  # each in a process group of its own: none is left
        assert started.proc.returncode is not None, started.name


def _info(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/server_info", timeout=10).json()  # type: ignore[no-any-return]


def _counters(url: str) -> dict[str, int]:
    info = _info(url)
    return {k: int(info.get(k) or 0) for k in ("finished_requests", "prompt_tokens")}


@pytest.mark.parametrize("fleet", ["mooncake", "torch"], indirect=True)
def test_prefill_and_decode_behind_smg(fleet: Any, expected: dict[str, list[str]]) -> None:
    idle = {url: _info(url) for url in fleet.worker_urls}
    for url, info in idle.items():
        assert info["num_running_requests"] == info["num_waiting_requests"] == 0, url
    mode = {url: _info(url)["disaggregation_mode"] for url in fleet.worker_urls}
    assert mode == {fleet.prefill_url: "prefill", fleet.decode_url: "decode"}
    _registered_as_a_pair(fleet)
    before = {url: _counters(url) for url in fleet.worker_urls}
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60)
    sent = _one_at_a_time(fleet, client, expected)
    sent += _concurrently(fleet, expected)
    _both_halves_served(fleet, before, sent)
    _no_prefill_server_is_an_error(fleet)
    _idle_again(fleet, idle)
    log = fleet.processes[0].log.read_text(errors="replace")
    assert "PD admission is off" not in log


def _registered_as_a_pair(fleet: Any) -> None:
    workers = httpx.get(f"{fleet.url}/workers", timeout=10).json()["workers"]
    kinds = {w["url"]: w["worker_type"] for w in workers}
    assert kinds == {fleet.prefill_url: "prefill", fleet.decode_url: "decode"}, workers
    prefill = next(w for w in workers if w["worker_type"] == "prefill")
    assert prefill["bootstrap_port"] == fleet.bootstrap_port
    assert all(w["status"] == "ready" for w in workers), workers


def _one_at_a_time(fleet: Any, client: openai.OpenAI, expected: dict[str, list[str]]) -> int:
    extra = {"ignore_eos": True}
    out = client.completions.create(
        model="tandem-tiny", prompt=COMPLETIONS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body=extra,
    )  # fmt: skip
    assert out.choices[0].text == expected["completions"][0]
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == MAX_TOKENS
    chunks = client.completions.create(
        model="tandem-tiny", prompt=COMPLETIONS[1], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body=extra,
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["completions"][1]
    chat = client.chat.completions.create(
        model="tandem-tiny", messages=[{"role": "user", "content": CHATS[0]}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body=extra,
    )  # fmt: skip
    assert chat.choices[0].message.content == expected["chat"][0]
    stream = client.chat.completions.create(
        model="tandem-tiny", messages=[{"role": "user", "content": CHATS[1]}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected["chat"][1]
    body = {"text": COMPLETIONS[2], "sampling_params": SAMPLING}
    native = httpx.post(f"{fleet.url}/generate", json=body, timeout=60)
    assert native.status_code == 200, native.text
    assert native.json()["text"] == expected["completions"][2]
    with httpx.stream(
        "POST", f"{fleet.url}/generate", json={**body, "stream": True}, timeout=60
    ) as streamed:
        assert streamed.status_code == 200
        events = [line[5:].strip() for line in streamed.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == expected["completions"][2]  # the text so far
    return 6


def _concurrently(fleet: Any, expected: dict[str, list[str]]) -> int:
    """16 requests at once: completions and chats, half of them streamed."""
    client = openai.AsyncOpenAI(
        base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60
    )
    extra = {"ignore_eos": True}

    async def completion(i: int) -> str:
        args = {"model": "tandem-tiny", "prompt": COMPLETIONS[i], "max_tokens": MAX_TOKENS}
        if i % 2:
            chunks = await client.completions.create(
                **args, temperature=0, stream=True, extra_body=extra
            )
            return "".join([c.choices[0].text async for c in chunks if c.choices])
        out = await client.completions.create(**args, temperature=0, extra_body=extra)
        return out.choices[0].text

    async def chat(i: int) -> str:
        args = {
            "model": "tandem-tiny", "messages": [{"role": "user", "content": CHATS[i]}],
            "max_tokens": MAX_TOKENS,
        }  # fmt: skip
        if i % 2 == 0:
            chunks = await client.chat.completions.create(
                **args, temperature=0, stream=True, extra_body=extra
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        out = await client.chat.completions.create(**args, temperature=0, extra_body=extra)
        return out.choices[0].message.content or ""

    async def main() -> tuple[list[str], list[str]]:
        try:
            done = await asyncio.wait_for(
                asyncio.gather(
                    asyncio.gather(*(completion(i) for i in range(len(COMPLETIONS)))),
                    asyncio.gather(*(chat(i) for i in range(len(CHATS)))),
                ),
                90,
            )
            return list(done[0]), list(done[1])
        finally:
            await client.close()

    completions, chats = asyncio.run(main())
    assert completions == expected["completions"]
    assert chats == expected["chat"]
    return len(COMPLETIONS) + len(CHATS)


def _both_halves_served(fleet: Any, before: dict[str, dict[str, int]], sent: int) -> None:
    """Each request was prefilled on the prefill server and decoded on the decode server
    (the engine's figures reach each API process a few times a second)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        delta = {
            url: {k: v - before[url][k] for k, v in _counters(url).items()}
            for url in fleet.worker_urls
        }
        if all(d["finished_requests"] >= sent for d in delta.values()):
            break
        assert time.monotonic() < deadline, (sent, delta)
        time.sleep(0.1)
    assert all(d["finished_requests"] == sent for d in delta.values()), (sent, delta)


def _held(info: dict[str, Any]) -> int:
    """KV tokens neither free nor in the radix cache: held by requests."""
    return int(info["max_total_tokens"] - info["available_kv_tokens"] - info["cached_kv_tokens"])


def _no_prefill_server_is_an_error(fleet: Any) -> None:
    """A decode server told of a prefill server that is not there: an error naming it
    (OpenAI's routes), the engine's abort and message (``/generate``)."""
    closed = pd_bench.free_port()
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": closed, "bootstrap_room": 1}
    chat = {"messages": [{"role": "user", "content": CHATS[0]}], "max_tokens": 4, **boot}
    for stream in (False, True):
        response = httpx.post(
            f"{fleet.decode_url}/v1/chat/completions", json={**chat, "stream": stream}, timeout=60
        )
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "disaggregation_failed", error
        assert f"127.0.0.1:{closed} is unreachable" in error["message"], error
    body = {"text": COMPLETIONS[0], "sampling_params": SAMPLING, **boot}
    native = httpx.post(f"{fleet.decode_url}/generate", json=body, timeout=60).json()
    assert native["meta_info"]["finish_reason"]["type"] == "abort", native


def _idle_again(fleet: Any, idle: dict[str, dict[str, Any]]) -> None:
    """Every row back, every KV page free or in the radix cache as before the requests;
    then, flushed, every page free."""
    for url, before in idle.items():
        deadline = time.monotonic() + WAIT_S
        while True:
            info = _info(url)
            settled = (
                info["num_running_requests"] == info["num_waiting_requests"] == 0
                and info["free_rows"] == before["free_rows"]
                and _held(info) == _held(before)
            )
            if settled:
                break
            shown = {k: (info[k], before[k]) for k in IDLE_KEYS}
            assert time.monotonic() < deadline, (url, "(now, idle before)", shown)
            time.sleep(0.1)
        assert info["max_total_tokens"] == before["max_total_tokens"]
        flushed = httpx.post(f"{url}/flush_cache", timeout=30)
        assert flushed.status_code == 200, flushed.text
        free = before["available_kv_tokens"] + before["cached_kv_tokens"]
        deadline = time.monotonic() + WAIT_S
        while (info := _info(url))["available_kv_tokens"] != free:
            shown = {k: (info[k], before[k]) for k in IDLE_KEYS}
            assert time.monotonic() < deadline, (url, "(now, idle before)", shown)
            time.sleep(0.1)
        assert info["cached_kv_tokens"] == 0


def test_the_scripts_comparison_table() -> None:
    pd = {"completed": 8, "failed": 0, "mean_ttft_ms": 30.0, "mean_tpot_ms": 4.0}
    plain = {"completed": 8, "failed": 0, "mean_ttft_ms": 20.0, "mean_tpot_ms": None}
    rows = {
        line[:36].strip(): line[36:].split()
        for line in pd_bench.side_by_side(pd, plain).splitlines()[1:]
    }
    assert rows["Mean TTFT (ms)"] == ["30.00", "20.00", "1.50"]
    assert rows["Mean TPOT (ms)"] == ["4.00", "-", "-"]
    assert rows["Failed requests"] == ["0", "0", "-"]
    assert rows["Output token throughput (tok/s)"] == ["-", "-", "-"]
    assert pd_bench._flag_value(["--model-path", "/m", "--x=1"], "--model-path") == "/m"
    assert pd_bench._flag_value(["--endpoint=chat"], "--endpoint") == "chat"
    assert pd_bench._flag_value(["--num-prompts", "8"], "--endpoint") is None
