"""The serving path's own cost: host CPU per scheduler step and per-token delivery.

Starts ``tandem serve`` with the tiny test model on a free loopback port, runs
``tandem bench serve`` at each ``--concurrency`` (all streams at once, greedy, fixed
lengths) and reads, around each run, the CPU time of the API process and of the
scheduler process (Linux ``/proc``) and the engine's ``forward_steps`` counter. Prints
one JSON line per concurrency: CPU milliseconds per step in each process, and the
inter-token latency (ITL) the clients saw, which is the per-token delivery latency.

    python tools/bench_serve_path.py --concurrency 64 256 --output-json out.json

Run it from two checkouts (``PYTHONPATH`` set to each one's ``packages/*/src``) to
compare them on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(entry.name))
    return out


def _steps(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem_forward_steps_total "):
            return float(line.split()[1])
    raise KeyError("tandem_forward_steps_total")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--device", "cpu"]
    cmd += ["--model-path", "tandem-tiny"]
    server = subprocess.Popen([*cmd, "--port", str(port)], stderr=subprocess.DEVNULL)
    results = []
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        sched = _children(server.pid)
        for conc in args.concurrency:
            out = Path(tempfile.mkdtemp()) / "bench.json"
            api0, sch0 = _cpu_s(server.pid), sum(_cpu_s(p) for p in sched)
            steps0 = _steps(url)
            subprocess.run(
                [
                    sys.executable, "-m", "tandem.server.cli", "bench", "serve",
                    "--base-url", url, "--num-prompts", str(conc), "--max-concurrency",
                    str(conc), "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--output-json", str(out),
                ],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            steps = _steps(url) - steps0
            api = _cpu_s(server.pid) - api0
            sch = sum(_cpu_s(p) for p in sched) - sch0
            figures = json.loads(out.read_text())
            row = {
                "concurrency": conc,
                "steps": steps,
                "api_cpu_ms_per_step": 1000 * api / steps,
                "scheduler_cpu_ms_per_step": 1000 * sch / steps,
                "median_itl_ms": figures["median_itl_ms"],
                "p99_itl_ms": figures["p99_itl_ms"],
                "output_throughput": figures.get("output_throughput"),
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        server.terminate()
        server.wait(60)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
