"""``tandem serve --tp-size 2`` on the CPU: the same greedy text as one rank, a rank
that dies ends the server with an error naming it, and a size the model cannot be
split by is refused at start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_process import live_server, process_alive, scheduler_pid, stream_in_background

KEY = "sk-tensor-parallel"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["Once upon a time", "ROMEO:", "The king said to the queen"]


def _greedy_texts(url: str) -> list[str]:
    body = {"prompt": PROMPTS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def test_tp2_serves_the_same_greedy_text_as_one_rank(tmp_path: Path) -> None:
    with live_server(tmp_path, "--api-key", KEY, "--tp-size", "2") as server:
        sharded = _greedy_texts(server.url)
        info = httpx.get(f"{server.url}/get_server_info", headers=AUTH, timeout=10).json()
        assert info["tp_size"] == 2
    with live_server(tmp_path, "--api-key", KEY) as server:
        assert _greedy_texts(server.url) == sharded


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_a_dead_rank_ends_the_server_with_an_error_naming_it(tmp_path: Path) -> None:
    with live_server(tmp_path, "--api-key", KEY, "--tp-size", "2") as server:
        scheduler = scheduler_pid(server.url, AUTH)
        (follower,) = _children(scheduler)
        reader, lines = stream_in_background(server.url, AUTH)
        time.sleep(1.0)
        subprocess.run(["kill", "-9", str(follower)], check=True)
        reader.join(timeout=30)
        assert not reader.is_alive(), "the in-flight stream hung"
        assert any('"error"' in line for line in lines)
        # The server does not go on without a rank: it exits non-zero, saying why.
        assert server.proc.wait(timeout=60) != 0
        assert f"rank 1 (pid {follower}) exited" in server.stderr()
        deadline = time.monotonic() + 10
        while process_alive(scheduler) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(scheduler)


def test_a_tp_size_the_model_cannot_split_is_refused_with_the_numbers(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--device", "cpu", "--tp-size", "3"]
    cmd += ["--model-path", "tandem-tiny"]
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "--tp-size" in done.stderr
    assert "tp_size=3 does not divide the model's num_attention_heads=4" in done.stderr
