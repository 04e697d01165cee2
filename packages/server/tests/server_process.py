"""Start a live ``tandem serve`` subprocess on a free port, for the tests.

It serves the tiny test model (``--model-path tandem-tiny``, served under that name)
unless the test's flags name another model."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models.tiny import cache_root

TINY_MODEL = "tandem-tiny"  # tandem.scheduler.models.source.TINY_MODEL


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path  # the server's stderr, replayed to the test's stderr when it stops

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def share_kernels(cache_dir: Path) -> None:
    """Give a server whose cache is ``cache_dir`` the CPU kernels this machine built once
    (in this process's cache, under a lock): each server would otherwise build them into
    its own new cache, a minute on two slow cores, and several building at once overran
    the wait for a healthy server."""
    shared = cache_root() / "kernels"
    cpu_build.load_cpu_kernels(shared)
    link = cache_root(cache_dir) / "kernels"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)


@contextmanager
def live_server(cache_dir: Path, *extra: str, timeout_s: float = 120.0) -> Iterator[LiveServer]:
    share_kernels(cache_dir)
    # free_port's port is free when it returns, not when the server binds it: another
    # test's process (or this server's own rendezvous and gloo sockets) may take it in
    # between. A server that lost that race starts again on a fresh port.
    for attempt in range(3):
        port = free_port()
        env = {**os.environ, "TANDEM_CACHE_DIR": str(cache_dir), "TANDEM_DEBUG_FUTURES": "1"}
        cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--port", str(port)]
        cmd += ["--device", "cpu", "--model-path", TINY_MODEL, *extra]
        fd, name = tempfile.mkstemp(prefix="tandem-serve-", suffix=".log")
        log = Path(name)
        with os.fdopen(fd, "wb") as stderr:
            proc = subprocess.Popen(cmd, env=env, stderr=stderr)
        try:
            _wait_healthy(proc, log, f"http://127.0.0.1:{port}", timeout_s)
        except _PortTaken:
            _stop(proc, log)
            if attempt == 2:
                raise RuntimeError("three ports were taken before the server bound them") from None
            continue
        except BaseException:
            _stop(proc, log)
            raise
        break
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", proc, log)
    finally:
        _stop(proc, log)


class _PortTaken(Exception):
    pass


def _wait_healthy(proc: subprocess.Popen[bytes], log: Path, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            if "address already in use" in log.read_text(errors="replace"):
                raise _PortTaken
            raise RuntimeError(f"the server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become healthy")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    sys.stderr.write(log.read_text(errors="replace"))
    log.unlink()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def metric_at_least(url: str, name: str, floor: float, timeout: float = 10.0) -> float:
    """The metric once it reaches ``floor`` (or its last value after ``timeout``): the
    engine's figures reach the API process periodically, not with each response."""
    deadline = time.monotonic() + timeout
    value = metric(url, name)
    while value < floor and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric(url, name)
    return value


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of ``/metrics`` (a labelled one under its name with its labels)."""
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=5)
    response.raise_for_status()
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def scheduler_pid(url: str, headers: dict[str, str]) -> int:
    """The scheduler process's pid (``/get_server_info`` shows it only with the API key)."""
    info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=10).json()
    return int(info["scheduler_pid"])


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waits for its parent to reap it; it runs nothing.
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # gone meanwhile; or no /proc at all, and kill said alive
        return not Path("/proc/self").exists()


def stream_in_background(url: str, headers: dict[str, str]) -> tuple[threading.Thread, list[str]]:
    """A long streamed completion read on a thread (started): its SSE lines collect in
    the list, so a test can break the server under it and see how the stream ends."""
    body = {"prompt": "hello", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    lines: list[str] = []

    def read() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30
        ) as r:
            lines.extend(r.iter_lines())

    reader = threading.Thread(target=read)
    reader.start()
    return reader, lines


def call_asgi(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request to an ASGI app in this process (no server, no socket)."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1:30000", timeout=10
        ) as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())
