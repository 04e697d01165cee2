#!/usr/bin/env python3
"""The memory ``tandem serve`` holds with the default model's weights in each form.

For each configuration the server starts alone (``--max-total-tokens 4096``, so the KV
pool is the same small size every time), answers one request, and then its processes'
memory is read from ``/proc``: the resident set (RSS) and the proportional set (PSS,
shared pages split between the processes that map them) summed over the server's
process tree, and the weights' own bytes as the server reports them
(``/get_server_info``'s ``weights_bytes``). One JSON file and a Markdown table.

    python tools/serve_memory.py --output-json benchmarks/results/cpu/memory/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_cpu as bench  # the sibling scripts
import llamacpp_build

CONFIGS: dict[str, tuple[str, list[str]]] = {
    "Q4_1 blocks (the default)": ("smollm2", []),
    "Q8_0 blocks": ("smollm2-q8_0", []),
    "weight-only int8": ("smollm2", ["--quantization", "int8"]),
    "bfloat16": ("smollm2", ["--quantization", "none", "--dtype", "bfloat16"]),
    "float32": ("smollm2", ["--quantization", "none", "--dtype", "float32"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        children = Path(f"/proc/{current}/task/{current}/children")
        if children.exists():
            todo += [int(c) for c in children.read_text().split()]
    return out


def _memory(pids: list[int]) -> dict[str, int]:
    """RSS and PSS in bytes, summed over ``pids`` (``/proc/PID/smaps_rollup``)."""
    total = {"rss": 0, "pss": 0}
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                total[key.lower()] += int(rest.split()[0]) * 1024
    return total


def measure(model: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    port = _free_port()
    command = [sys.executable, "-m", "tandem.server.cli", "serve", "--model-path", str(model)]
    command += ["--device", "cpu", "--port", str(port), "--max-total-tokens", "4096", *extra]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem serve {' '.join(extra)} did not start")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 16}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
        info = httpx.get(f"{url}/get_server_info", timeout=10, trust_env=False).json()
        time.sleep(1)
        memory = _memory(_tree(process.pid))
        keys = ("quantization", "dtype", "weights_bytes")
        return {**memory, **{k: info.get(k) for k in keys}, "command_extra": extra}
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    llama = llamacpp_build.resolve_build(None, llamacpp_build.DEFAULT_DIR)
    rows = {}
    for name, (model, extra) in CONFIGS.items():
        file = bench.gguf_file(model, None, llama, llamacpp_build.DEFAULT_DIR)
        rows[name] = measure(file, extra, args.timeout)
        row = rows[name]
        print(
            f"{name}: RSS {row['rss'] / 2**20:.0f} MiB, PSS {row['pss'] / 2**20:.0f} MiB, "
            f"weights {row['weights_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    record = {
        "benchmark": "serve_memory",
        "command": " ".join(["python", "tools/serve_memory.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": bench.machine(),
        "results": rows,
    }
    if args.output_json:
        args.output_json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
