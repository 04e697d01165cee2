#!/usr/bin/env python3
"""Overlap vs normal loop on a decode-heavy workload, in one process.

Runs the same batch of requests through the normal loop and the overlap loop,
alternating (normal, overlap, normal, overlap, ...) so machine noise hits both alike,
and reports for each loop the median wall time, output throughput and the device idle
fraction read from ``Engine.get_server_info()``.

    python tools/bench_overlap.py                       # the tiny test model
    python tools/bench_overlap.py --hidden-size 512     # a larger dummy model
    python tools/bench_overlap.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.scheduler import Engine
from tandem.scheduler.models.tiny import default_model_path


def _dummy_checkpoint(hidden: int, layers: int, folder: Path) -> Path:
    """The tiny test model's config scaled up; weights come from load_format=dummy."""
    base = json.loads((default_model_path() / "config.json").read_text())
    heads = max(4, hidden // 64)
    base.update(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
    )
    base.pop("head_dim", None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(base))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = default_model_path() / name
        if src.exists():
            (folder / name).write_bytes(src.read_bytes())
    return folder


def _one_run(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    before = engine.get_server_info()
    start = time.perf_counter()
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
    )
    wall = time.perf_counter() - start
    after = engine.get_server_info()
    busy = after["device_busy_s"] - before["device_busy_s"]
    idle = after["device_idle_s"] - before["device_idle_s"]
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "wall_s": wall,
        "output_throughput": tokens / wall,
        "device_idle_fraction": idle / (busy + idle) if busy + idle > 0 else 0.0,
        "scheduler_s": after["scheduler_s"] - before["scheduler_s"],
        "overshoot_steps": after["overshoot_steps"] - before["overshoot_steps"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default="tandem-tiny", help="checkpoint (default: the tiny test model)"
    )
    parser.add_argument("--hidden-size", type=int, help="use a dummy model of this width")
    parser.add_argument("--layers", type=int, default=4, help="layers of the dummy model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per loop")
    parser.add_argument("--output-json", help="write the figures here")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's choice)"
    )
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        options: dict[str, Any] = {"device": "cpu", "dtype": "float32"}
        path = args.model_path
        if args.hidden_size:
            path = str(_dummy_checkpoint(args.hidden_size, args.layers, Path(tmp) / "m"))
            options["load_format"] = "dummy"
        engines = {
            name: Engine(model_path=path, disable_overlap_schedule=name == "normal", **options)
            for name in ("normal", "overlap")
        }
        vocab = engines["normal"].model_config.vocab_size
        rng = random.Random(0)
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.requests)
        ]
        runs: dict[str, list[dict[str, float]]] = {"normal": [], "overlap": []}
        for engine in engines.values():
            _one_run(engine, prompts[:2], 4)  # warm-up
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(_one_run(engine, prompts, args.output_len))
        for engine in engines.values():
            engine.shutdown()

    report = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    report["overlap_vs_normal_wall"] = report["overlap"]["wall_s"] / report["normal"]["wall_s"]
    for name in ("normal", "overlap"):
        r = report[name]
        print(
            f"{name:8s} wall {r['wall_s']:.3f} s  {r['output_throughput']:.0f} tok/s  "
            f"device idle {100 * r['device_idle_fraction']:.1f}%  "
            f"scheduler {r['scheduler_s']:.3f} s  overshoot {r['overshoot_steps']:.0f}"
        )
    print(f"overlap / normal wall time: {report['overlap_vs_normal_wall']:.3f}")
    if args.output_json:
        command = shlex.join(["python", "tools/bench_overlap.py", *arguments])
        document = {**report, "command": command}
        Path(args.output_json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
