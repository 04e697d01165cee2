"""``tandem serve`` replicas behind the SGLang Model Gateway, and ``tandem bench serve``
through it.

Starts ``--workers`` CPU workers (``tandem serve --device cpu``, the tiny test model
``tandem-tiny`` unless ``--worker-args`` names another) on free loopback ports, then ``smg launch``
in front of them (``--policy cache_aware`` by default), waits until every worker
answers ``/health`` and the gateway counts them all healthy (``--timeout`` bounds each
wait), runs ``tandem bench serve`` against the gateway, prints its report and how many
requests each worker served, and stops every process it started: also on Ctrl+C, on
SIGTERM and on a failure. Needs the ``smg`` package (``pip install smg``); ``nox -s
gateway`` installs it and runs this. Arguments after ``--`` go to ``tandem bench serve``
(default: ``--num-prompts 64 --random-input-len 128 --random-output-len 32``)::

    python tools/gateway_bench.py
    python tools/gateway_bench.py --policy round_robin -- --num-prompts 128

docs/guides/scaling-out.md explains the setup; ``fleet`` is also what
packages/server/tests/test_gateway.py runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DEFAULT_BENCH = ("--num-prompts", "64", "--random-input-len", "128", "--random-output-len", "32")
STOP_TIMEOUT_S = 20.0
_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Started:
    """One process this script started, in a session of its own (its own process group,
    so a terminal's Ctrl+C reaches this script alone, which stops it in order)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclass
class Fleet:
    """The gateway and the workers behind it."""

    url: str
    """The gateway's base URL."""
    worker_urls: list[str]
    processes: list[Started] = field(default_factory=list)


def _start(name: str, cmd: Sequence[str], logs: Path, env: Mapping[str, str]) -> Started:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )
    return Started(name, proc, log)


def _stop(processes: Sequence[Started]) -> None:
    """SIGTERM to each (a worker drains and stops its scheduler process), then SIGKILL to
    the process group of any that has not exited in time, and to every group once more,
    so that no child is left behind either way."""
    for started in processes:
        if started.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                started.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for started in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            started.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(started.proc.pid, signal.SIGKILL)
        started.proc.wait()


def _wait_until(what: str, ready: Any, processes: Sequence[Started], timeout_s: float) -> None:
    """Poll ``ready()`` until true; fail when a process exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        for started in processes:
            if started.proc.poll() is not None:
                raise RuntimeError(
                    f"{started.name} exited with {started.proc.returncode} while waiting for "
                    f"{what}; its log ends:\n{started.tail()}"
                )
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(_POLL_S)


def _healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=2).status_code == 200


def _gateway_ready(url: str, workers: int) -> bool:
    response = httpx.get(f"{url}/readiness", timeout=2)
    return response.status_code == 200 and response.json().get("healthy_workers") == workers


def serve_command(port: int, *args: str) -> list[str]:
    """``tandem serve`` on the CPU, on loopback ``port``, with ``args``."""
    cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--device", "cpu"]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port), *args]


def wait_healthy(urls: Sequence[str], processes: Sequence[Started], timeout_s: float) -> None:
    """Wait for each server of ``processes`` (in order) to answer ``/health`` at its URL."""
    for url, started in zip(urls, processes, strict=True):
        _wait_until(f"{started.name} at {url}", lambda u=url: _healthy(u), processes, timeout_s)


@contextlib.contextmanager
def launched(prefix: str, logs: Path | None) -> Iterator[tuple[Path, list[Started]]]:
    """The folder for the processes' output (``logs``, or a temporary one removed
    afterwards) and the list to start them into; every one of them is stopped on the
    way out, in the list's order."""
    with contextlib.ExitStack() as stack:
        folder = logs or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        processes: list[Started] = []
        stack.callback(_stop, processes)
        yield folder, processes


def start_gateway(
    routing: Sequence[str],
    workers: int,
    smg_args: Sequence[str],
    processes: list[Started],
    folder: Path,
    env: Mapping[str, str],
    timeout_s: float,
) -> str:
    """``smg launch`` on a free loopback port with ``routing`` (its worker arguments),
    put first in ``processes`` (stopped before the workers it routes to); returns its
    URL once it counts ``workers`` healthy workers."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "smg", "launch", *routing,
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        # Nothing is in flight when this stops it: no drain window to wait out.
        "--shutdown-grace-period-secs", "0", "--log-level", "warn", *smg_args,
    ]  # fmt: skip
    processes.insert(0, _start("smg", cmd, folder, env))
    url = f"http://127.0.0.1:{port}"
    _wait_until(
        f"the gateway at {url} with {workers} healthy workers",
        lambda: _gateway_ready(url, workers), processes, timeout_s,
    )  # fmt: skip
    return url


@contextlib.contextmanager
def fleet(
    workers: int = 2,
    policy: str = "cache_aware",
    worker_args: Sequence[str] = (),
    smg_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    logs: Path | None = None,
) -> Iterator[Fleet]:
    """``workers`` CPU ``tandem serve`` processes behind ``smg launch --policy policy``,
    all on loopback, ready to route; every one of them stopped on the way out.

    ``env`` is the workers' environment (default: this process's); ``logs`` the folder
    of each process's output (default: a temporary one, removed afterwards).
    """
    env = dict(os.environ if env is None else env)
    with launched("smg-", logs) as (folder, processes):
        urls = []
        for i in range(workers):
            port = free_port()
            processes.append(_start(f"worker{i}", serve_command(port, *worker_args), folder, env))
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(urls, processes, timeout_s)
        routing = ["--worker-urls", *urls, "--policy", policy]
        url = start_gateway(routing, workers, smg_args, processes, folder, env, timeout_s)
        yield Fleet(url, urls, processes)


def served(worker_url: str) -> dict[str, int]:
    """A worker's counters: requests finished, prompt tokens, those served from cache
    (the engine's figures, as they last reached the worker's API process)."""
    info = httpx.get(f"{worker_url}/get_server_info", timeout=10).json()
    keys = ("finished_requests", "prompt_tokens", "cached_tokens")
    return {key: int(info.get(key) or 0) for key in keys}


def answered(worker_url: str) -> int:
    """Requests a worker has finished, counted in its API process as each one ends."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines())
    return int(sum(float(v) for name, v in samples if name.startswith("tandem_requests_total{")))


def served_since(
    worker_urls: Sequence[str], before: Sequence[dict[str, int]], timeout_s: float = 10.0
) -> list[dict[str, int]]:
    """Each worker's ``served`` counters since ``before``, once its engine's figures
    count every request its API process has answered (they arrive a few times a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = [answered(url) for url in worker_urls]
        now = [served(url) for url in worker_urls]
        deltas = [{k: n[k] - b[k] for k in n} for n, b in zip(now, before, strict=True)]
        if all(n["finished_requests"] >= d for n, d in zip(now, done, strict=True)):
            return deltas
        if time.monotonic() > deadline:
            return deltas
        time.sleep(_POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, bench_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2, help="(default: 2)")
    parser.add_argument(
        "--policy", default="cache_aware", help="smg's --policy (default: %(default)s)"
    )
    parser.add_argument(
        "--worker-args", default="", help='more `tandem serve` flags, one string ("--page-size 16")'
    )
    parser.add_argument("--smg-args", default="", help="more `smg launch` flags, one string")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each startup wait may take (300)"
    )
    args = parser.parse_args(ours)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    from tandem.server.bench import serve as bench_serve

    worker_args = shlex.split(args.worker_args)
    if not any(a.startswith("--model-path") for a in worker_args):
        worker_args += ["--model-path", "tandem-tiny"]
    if not any(a.startswith("--cpu-forward-threads") for a in worker_args):
        # The workers share this machine's cores instead of each taking them all.
        threads = max(1, (os.cpu_count() or 1) // args.workers)
        worker_args += ["--cpu-forward-threads", str(threads)]
    with fleet(
        args.workers, args.policy, worker_args, shlex.split(args.smg_args), timeout_s=args.timeout
    ) as running:
        print(f"smg --policy {args.policy} at {running.url} -> {' '.join(running.worker_urls)}")
        before = [served(url) for url in running.worker_urls]
        code = bench_serve.main(["--base-url", running.url, *(bench_args or DEFAULT_BENCH)])
        deltas = served_since(running.worker_urls, before)
        for url, delta in zip(running.worker_urls, deltas, strict=True):
            print(
                f"{url}: {delta['finished_requests']} requests, {delta['prompt_tokens']} prompt "
                f"tokens, {delta['cached_tokens']} of them from its radix cache"
            )
    return code


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl+C, so the processes started here are stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
