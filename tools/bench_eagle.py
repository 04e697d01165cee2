#!/usr/bin/env python3
"""EAGLE-3 on the default model, served: tandem with its built-in head against the same
server without speculation, on the head's held-out chat prompts.

1. One ``tandem serve`` per configuration (``CONFIGS``: ``plain``, ``chain`` and
   ``tree``; ``--configs`` picks), the default model, each on a free loopback port, all
   up at once (an idle server costs next to nothing), each waited for on ``/health`` and
   warmed up. ``--tandem-arg`` goes to every one (``--tandem-arg=--quantization=none``
   for the float32 target).
2. At each ``--concurrency`` C, ``--repeats`` rounds of ``tandem bench serve --endpoint
   chat`` against every server, the order reversed every other round: the prompts are
   the human turns of ``tools/data/smollm2_heldout_chat.json`` (topics the head never
   saw in training, written by ``tools/train_eagle.py chat``), ``max(16, 2 x C)`` of
   them, shuffled by a seed of the round; each answer is as long as the target's own
   greedy answer (greedy, ``ignore_eos``), so every server makes the same tokens.
   ``--configs`` may add ``llamacpp``: llama.cpp's ``llama-server`` (built by
   ``tools/llamacpp_build.py``) on the same GGUF file, its chat template run by
   ``--jinja``, measured by the same client beside tandem.
3. One JSON file: the command, the machine, the versions, each server's command, and per
   concurrency each configuration's median round (output tokens/s, accept length,
   latencies), every round's throughput, and the speedup over ``plain``.
   The Benchmarks page quotes its figures.

    python tools/bench_eagle.py --output-json benchmarks/results/cpu/eagle3/smollm2-q4_1-gguf.json

Server logs and the raw ``bench serve`` files go to ``build/bench-eagle/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import bench_vllm_cpu as peers  # the sibling script: servers, machine, versions
import llamacpp_build
from bench_vllm_cpu import Failure, Server, log

from tandem.server.bench.offline import median_run

ROOT = peers.ROOT
BENCHMARK_ID = "eagle3_cpu"
SCHEMA_VERSION = 1
WORK_DIR = ROOT / "build" / "bench-eagle"
HELDOUT = ROOT / "tools" / "data" / "smollm2_heldout_chat.json"
# Each configuration's speculative options (SGLang's flags); plain has none.
CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "chain": [
        "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
    ],
    "tree": [
        "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
    ],
}  # fmt: skip
FIGURES = (*peers.FIGURES, "spec_accept_length", "spec_verify_steps")
LLAMACPP = "llamacpp"  # the peer: llama.cpp's server on the same GGUF file
LLAMACPP_CONTEXT = 4096  # per slot: a held-out prompt and its answer, with room


def server(args: argparse.Namespace, config: str, port: int) -> Server:
    if config == LLAMACPP:
        return llamacpp_server(args, port)
    command = [
        sys.executable, "-m", "tandem.server.cli", "serve", "--device", "cpu",
        "--host", peers.HOST, "--port", str(port), *CONFIGS[config], *args.tandem_arg,
    ]  # fmt: skip
    return Server(config, command, {}, args.work_dir / f"{args.tag}-{config}.log")


def llamacpp_server(args: argparse.Namespace, port: int) -> Server:
    """llama-server on the default model's GGUF file: one slot per request in flight at
    the highest concurrency, every usable core, the file's chat template."""
    slots = max(args.concurrency)
    binary = args.llama.binary("llama-server")
    command = [
        str(binary), "--model", str(args.checkpoint.path), "--jinja",
        "--host", peers.HOST, "--port", str(port),
        "--threads", str(len(os.sched_getaffinity(0))),
        "--parallel", str(slots), "--ctx-size", str(slots * LLAMACPP_CONTEXT),
    ]  # fmt: skip
    return Server(LLAMACPP, command, {}, args.work_dir / f"{args.tag}-{LLAMACPP}.log")


def num_prompts(concurrency: int) -> int:
    return max(16, 2 * concurrency)


def bench_serve(
    url: str, concurrency: int, prompts: int, seed: int, out: Path, tokenizer: Path
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "tandem.server.cli", "bench", "serve", "--base-url", url,
        "--tokenizer-path", str(tokenizer),
        "--endpoint", "chat", "--workload", "sharegpt", "--dataset-path", str(HELDOUT),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--output-json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise Failure(
            f"tandem bench serve (concurrency {concurrency}) exited with status "
            f"{done.returncode}:\n{peers._tail(done.stdout + done.stderr)}"
        )
    return dict(json.loads(out.read_text()))


def warm_up(args: argparse.Namespace, srv: Server, url: str) -> None:
    """One request alone, then the largest batch (a speculating server's first plain
    steps record its decode trace, as the plain server's first steps do), on other
    seeds than the timed runs."""
    top = max(args.concurrency)
    for concurrency, prompts in ((1, 2), (top, top)):
        bench_serve(
            url, concurrency, prompts, seed=7 + concurrency,
            out=args.work_dir / f"{args.tag}-{srv.name}-warm-c{concurrency}.json",
            tokenizer=args.checkpoint.tokenizer,
        )  # fmt: skip


def timed_run(
    args: argparse.Namespace, srv: Server, url: str, concurrency: int, round_: int
) -> dict[str, Any]:
    """One timed run; a failed request, or one shorter than asked, fails the benchmark."""
    prompts = num_prompts(concurrency)
    raw = bench_serve(
        url, concurrency, prompts, seed=1000 + concurrency + 10_000 * round_,
        out=args.work_dir / f"{args.tag}-{srv.name}-c{concurrency}-r{round_}.json",
        tokenizer=args.checkpoint.tokenizer,
    )  # fmt: skip
    row = {key: raw.get(key) for key in FIGURES}
    if row["failed"] or row["completed"] != prompts:
        raise Failure(
            f"{srv.name} at concurrency {concurrency}: {row['failed']} of {prompts} requests "
            f"failed ({raw.get('errors')}); the end of its log:\n{srv.log_tail()}"
        )
    if raw.get("output_lens") != raw.get("requested_output_lens"):
        raise Failure(f"{srv.name} at concurrency {concurrency}: outputs of other lengths")
    accept = row.get("spec_accept_length")
    log(
        f"{srv.name}: concurrency {concurrency}, round {round_ + 1}: "
        f"{row['output_throughput']:.1f} output tok/s"
        + (f", accept length {accept:.2f}" if accept else "")
    )
    return row


def run_rounds(
    args: argparse.Namespace, servers: dict[str, tuple[Server, str]]
) -> dict[str, dict[int, dict[str, Any]]]:
    """config -> concurrency -> its median round (``median_run``)."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {} for name in servers}
    for concurrency in args.concurrency:
        log(f"concurrency {concurrency}: {num_prompts(concurrency)} prompts")
        for round_ in range(args.repeats):
            for name in peers.round_order(list(servers), round_):
                srv, url = servers[name]
                runs[name].setdefault(concurrency, []).append(
                    timed_run(args, srv, url, concurrency, round_)
                )
    return {
        name: {c: median_run(rows) for c, rows in levels.items()} for name, levels in runs.items()
    }


def portable(args: argparse.Namespace, command: list[str]) -> list[str]:
    """A server's command as recorded: the GGUF file and llama.cpp's binaries named by
    placeholders, no path of this machine."""
    llama_bin = args.llama.binary("llama-server").parent if args.llama is not None else None
    return peers.portable(command, args.checkpoint.path, ROOT, llama_bin)


def record(
    args: argparse.Namespace,
    argv: list[str],
    servers: dict[str, tuple[Server, str]],
    results: dict[str, dict[int, dict[str, Any]]],
) -> dict[str, Any]:
    levels = []
    for c in args.concurrency:
        plain = results.get("plain", {}).get(c)
        row: dict[str, Any] = {"concurrency": c, "num_prompts": num_prompts(c)}
        for name in results:
            row[name] = results[name][c]
            if plain and name not in ("plain", LLAMACPP):
                row[f"{name}_speedup"] = (
                    results[name][c]["output_throughput"] / plain["output_throughput"]
                )
            peer = results.get(LLAMACPP, {}).get(c)
            if peer and name != LLAMACPP:
                row[f"{name}_vs_llamacpp"] = (
                    results[name][c]["output_throughput"] / peer["output_throughput"]
                )
        levels.append(row)
    return {
        "benchmark": BENCHMARK_ID,
        "schema_version": SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": peers._recorded_command(argv, __file__),
        "machine": peers.machine(),
        "versions": {
            **peers.tandem_versions(),
            **({"llamacpp": args.llama.record()} if args.llama is not None else {}),
        },
        "workload": {
            "prompts": HELDOUT.relative_to(ROOT).as_posix(),
            "endpoint": "chat",
            "output": "each prompt's held-out greedy answer length, greedy, ignore_eos",
            "repeats": args.repeats,
        },
        "servers": {
            name: {"command": portable(args, srv.command), "startup_s": srv.startup_s}
            for name, (srv, _) in servers.items()
        },
        "levels": levels,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", choices=[*CONFIGS, LLAMACPP], default=list(CONFIGS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 32])
    parser.add_argument("--repeats", type=int, default=3, help="rounds per level (default: 3)")
    parser.add_argument(
        "--tandem-arg",
        action="append",
        default=[],
        help="one more `tandem serve` argument for every configuration (repeat)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--output-json", type=Path, help="write the record here")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR)
    parser.add_argument("--tag", default="eagle3", help="log and raw-file name prefix")
    llamacpp_build.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not HELDOUT.is_file():
        raise SystemExit(f"{HELDOUT} is missing: run `python tools/train_eagle.py chat`")
    servers: dict[str, tuple[Server, str]] = {}
    args.checkpoint = peers.checkpoint_for("smollm2", None)  # the client's tokenizer
    args.llama = None
    if LLAMACPP in args.configs:
        args.llama = llamacpp_build.resolve_build(args.llama_bin_dir, args.llama_dir)
    try:
        for name in args.configs:
            port = peers._free_port()
            url = f"http://{peers.HOST}:{port}"
            srv = server(args, name, port)
            servers[name] = (srv, url)
            srv.launch()
        for srv, url in servers.values():
            srv.wait_ready(url, args.startup_timeout)
            warm_up(args, srv, url)
        results = run_rounds(args, servers)
    except Failure as exc:
        log(f"failed: {exc}")
        return 1
    finally:
        for srv, _ in servers.values():
            with contextlib.suppress(Exception):
                srv.stop()
    out = record(args, argv, servers, results)
    text = json.dumps(out, indent=2) + "\n"
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text)
        log(f"wrote {args.output_json}")
    for level in out["levels"]:
        parts = [f"{name} {level[name]['output_throughput']:.1f}" for name in args.configs] + [
            f"{k} {v:.2f}x" for k, v in level.items() if k.endswith(("_speedup", "_vs_llamacpp"))
        ]
        log(f"concurrency {level['concurrency']}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
