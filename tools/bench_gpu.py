#!/usr/bin/env python3
"""GPU benchmark: decode step time against the memory roofline, overlap against normal
loop, device idle time, and tandem against transformers, per model config.

Every model runs with dummy weights built from a config under ``benchmarks/configs/``
(nothing is downloaded). One JSON file per model records, besides the machine and the
command line:

- ``bandwidth``: the device's copy bandwidth, a large device-to-device copy (bytes read
  plus bytes written over the median time of the timed copies);
- ``decode``: per batch size B, the device time of one decode step (B requests of
  ``--context`` prompt tokens), the roofline time (weights plus KV cache read once at
  that bandwidth) and their ratio, the bandwidth utilisation; with CUDA graphs and, for
  ``--eager-batch-sizes``, without;
- ``overlap``: output tokens/s of one workload through the overlap loop and the normal
  loop, and their ratio;
- ``idle``: the device idle fraction over one whole run of the overlap loop (prefill
  included), from the torch profiler's kernel and memcpy intervals (CUDA only) and from the
  engine's own forward-stream timeline;
- ``transformers``: output tokens/s of tandem and of transformers' batched greedy
  ``generate`` on the same prompts, and their ratio.

    python tools/bench_gpu.py                               # both models: < 8 min on one H100
    python tools/bench_gpu.py --models llama-3.2-1b --quick # a fast sanity run
    python tools/bench_gpu.py --device cpu --quick --config-dir DIR --models tiny
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.scheduler.models import ModelConfig, resolve_dtype
from tandem.server.bench.offline import left_padded, median_run, synchronize

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_DIR = ROOT / "benchmarks" / "configs"
DEFAULT_OUT = "benchmarks/results/gpu/bench-gpu-{model}.json"
BENCHMARK_ID = "bench_gpu"  # how docs/hooks/bench_figures.py recognises these files
SCHEMA_VERSION = 1
STEP_TIME_METHOD = (
    "two-run difference of the engine timeline's device busy time: "
    "(busy(max_new_tokens=1+N) - busy(max_new_tokens=1)) / (decode steps counted), "
    "prompts already in the radix cache so both runs prefill one token per request; "
    "median over the repeats"
)
GPU_TRACE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """Every size of one run, after ``--quick`` and the explicit options are applied."""

    batch_sizes: tuple[int, ...]
    eager_batch_sizes: tuple[int, ...]
    context: int
    decode_steps: int
    repeats: int
    copy_bytes: int
    copy_repeats: int
    overlap_workload: tuple[int, int, int]  # requests, input tokens, output tokens
    hf_workload: tuple[int, int, int]


# The defaults, and the --quick ones: (full, quick) per option left unset.
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "batch_sizes": ("1,2,4,8,16,32,64,128,256", "1,8"),
    "eager_batch_sizes": ("1", "1"),
    "context": (512, 128),
    "decode_steps": (64, 8),
    "repeats": (3, 1),
    "copy_mib": (2048, 64),
    "copy_repeats": (10, 5),
    "overlap_workload": ("128x256x256", "8x32x32"),
    "hf_workload": ("32x256x128", "4x32x16"),
}


# -- arguments ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, cpu, ... (default: cuda)")
    parser.add_argument(
        "--models",
        default="llama-3.2-1b,llama-3.1-8b",
        help="comma-separated folders of --config-dir, each with a config.json",
    )
    parser.add_argument(
        "--config-dir", type=Path, default=DEFAULT_CONFIG_DIR, help="where the model folders are"
    )
    parser.add_argument("--dtype", default="bfloat16", help="weights and KV cache (bfloat16)")
    parser.add_argument(
        "--batch-sizes", help="decode batch sizes of the roofline sweep (1,2,4,...,256)"
    )
    parser.add_argument(
        "--eager-batch-sizes",
        help="batch sizes also measured with CUDA graphs off (default: 1; CUDA only)",
    )
    parser.add_argument("--context", type=int, help="prompt tokens per request (512)")
    parser.add_argument("--decode-steps", type=int, help="decode steps per measurement (64)")
    parser.add_argument("--repeats", type=int, help="timed repeats of each measurement (3)")
    parser.add_argument("--copy-mib", type=int, help="size of the bandwidth copy in MiB (2048)")
    parser.add_argument("--copy-repeats", type=int, help="timed copies (10)")
    parser.add_argument(
        "--overlap-workload",
        help="REQUESTSxINPUTxOUTPUT of the overlap/normal and idle runs (128x256x256)",
    )
    parser.add_argument(
        "--hf-workload", help="REQUESTSxINPUTxOUTPUT of the transformers comparison (32x256x128)"
    )
    parser.add_argument(
        "--attention-backend",
        help="the engine's attention backend (default: triton on CUDA, the engine's default "
        "elsewhere)",
    )
    parser.add_argument(
        "--cuda-graph-max-bs", type=int, default=256, help="largest captured batch (256)"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="no transformers run")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (0)")
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="output file; {model} is replaced by the model name (" + DEFAULT_OUT + ")",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a sanity run")
    return parser


def _ints(text: str, name: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError(f"--{name} needs positive integers, got {text!r}")
    return values


def _workload(text: str, name: str) -> tuple[int, int, int]:
    parts = tuple(int(v) for v in text.lower().split("x"))
    if len(parts) != 3 or min(parts) < 1:
        raise ValueError(f"--{name} is REQUESTSxINPUTxOUTPUT, got {text!r}")
    return parts[0], parts[1], parts[2]


def make_plan(args: argparse.Namespace) -> Plan:
    """The sizes: explicit options win, then the --quick or the full defaults."""
    value = {
        key: getattr(args, key) if getattr(args, key) is not None else pair[int(args.quick)]
        for key, pair in DEFAULTS.items()
    }
    for key in ("context", "decode_steps", "repeats", "copy_mib", "copy_repeats"):
        if value[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1")
    return Plan(
        batch_sizes=_ints(value["batch_sizes"], "batch-sizes"),
        eager_batch_sizes=_ints(value["eager_batch_sizes"], "eager-batch-sizes"),
        context=value["context"],
        decode_steps=value["decode_steps"],
        repeats=value["repeats"],
        copy_bytes=value["copy_mib"] << 20,
        copy_repeats=value["copy_repeats"],
        overlap_workload=_workload(value["overlap_workload"], "overlap-workload"),
        hf_workload=_workload(value["hf_workload"], "hf-workload"),
    )


# -- the machine ----------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    """What a reader needs to compare two files: the device, the software, the date."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or device.type
    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    return {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": hf_version,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _git_commit() -> str | None:
    """The checkout's commit, so a results file names the code it measured."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    """Copy bandwidth: what a decode step that streams the weights can hope for.

    A copy reads and writes every byte, so it moves ``2 * nbytes``; the figure is that
    over the median of ``repeats`` timed copies (device events on an accelerator, the
    host clock on the CPU) after a short warm-up."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cpu":
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
            continue
        module = torch.get_device_module(device)
        begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    del src, dst
    _free(device)
    median = statistics.median(times)
    return {
        "method": "device-to-device copy; bytes read + bytes written over the median time",
        "copy_bytes": nbytes,
        "bytes_moved": 2 * nbytes,
        "repeats": repeats,
        "median_s": median,
        "times_s": times,
        "bytes_per_s": 2 * nbytes / median,
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the model's bytes ----------------------------------------------------------------------------
def weight_bytes(mc: ModelConfig, dtype_bytes: int) -> dict[str, Any]:
    """Parameters a decode step reads, counted from the config.

    Every parameter is read once per step, except the input embedding: a step reads one
    row of it per token, nothing next to the rest, so it is left out. A tied embedding
    *is* the LM head, which every step reads whole, so it counts (once)."""
    h, q, kv, inter = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    attention = 2 * h * q + 2 * h * kv  # q, o; k, v
    attention += (q + 2 * kv) if mc.attention_bias else 0
    attention += h if mc.attention_out_bias else 0
    mlp = 3 * h * inter + ((2 * inter + h) if mc.mlp_bias else 0)
    norms = 2 * h + (2 * mc.head_dim if mc.qk_norm else 0)
    layers = mc.num_hidden_layers * (attention + mlp + norms)
    head = mc.vocab_size * h
    read = layers + h + head  # + the final norm
    total = read + (0 if mc.tie_word_embeddings else mc.vocab_size * h)
    return {
        "parameters": total,
        "parameters_read_per_step": read,
        "bytes_per_step": read * dtype_bytes,
        "input_embedding_counted": bool(mc.tie_word_embeddings),
    }


def kv_bytes_per_token(mc: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    return mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * dtype_bytes


def config_summary(mc: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    return {
        "architecture": mc.architecture,
        "hidden_size": mc.hidden_size,
        "num_hidden_layers": mc.num_hidden_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim,
        "intermediate_size": mc.intermediate_size,
        "vocab_size": mc.vocab_size,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "parameters": weights["parameters"],
    }


# -- engines --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """One engine setting: loop, CUDA graphs, and how much it must hold."""

    overlap: bool
    cuda_graph: bool
    rows: int
    tokens: int  # the longest request, prompt + output
    pool_tokens: int


def engine_options(args: argparse.Namespace, path: Path, spec: EngineSpec) -> dict[str, Any]:
    """The Engine's keyword options for ``spec``. CUDA-graph options go only to a CUDA
    engine: they mean nothing elsewhere."""
    device = torch.device(args.device)
    options: dict[str, Any] = {
        "model_path": str(path),
        "load_format": "dummy",
        "dtype": args.dtype,
        "device": args.device,
        "skip_tokenizer_init": True,
        "disable_progress_bar": True,
        "disable_overlap_schedule": not spec.overlap,
        "max_running_requests": spec.rows,
        "max_total_tokens": spec.pool_tokens,
        "context_length": spec.tokens,
    }
    backend = args.attention_backend or ("triton" if device.type == "cuda" else None)
    if backend:
        options["attention_backend"] = backend
    if device.type == "cuda":
        options["disable_cuda_graph"] = not spec.cuda_graph
        options["cuda_graph_max_bs"] = min(args.cuda_graph_max_bs, spec.rows)
    return options


def with_engine(
    args: argparse.Namespace, path: Path, spec: EngineSpec, work: Callable[[Any], T]
) -> T:
    """Build an engine, run ``work`` on it, and free it (memory included) before the
    next setting: two 8B engines at once would not fit beside each other's pools."""
    from tandem.scheduler import Engine

    device = torch.device(args.device)
    engine = Engine(**engine_options(args, path, spec))
    try:
        return work(engine)
    finally:
        engine.shutdown()
        del engine
        _free(device)


def engine_parameters(engine: Any) -> int | None:
    """Parameters the engine's model holds (tied ones once), to check the count from the
    config against; None where the engine's layout is not the expected one."""
    model = getattr(getattr(getattr(engine, "scheduler", None), "runner", None), "model", None)
    if model is None:
        return None
    return int(sum(p.numel() for p in model.parameters()))


# -- workloads ------------------------------------------------------------------------------------
def random_prompts(vocab: int, count: int, length: int, seed: tuple[Any, ...]) -> list[list[int]]:
    """Seeded random ids: the same prompts for every engine that runs one workload."""
    rng = random.Random(repr(seed))
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _params(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}


COUNTERS = ("device_busy_s", "device_idle_s", "decode_steps", "prefill_steps", "generated_tokens")


def counters(engine: Any) -> dict[str, Any]:
    """The engine's cumulative figures that runs are measured by, as differences."""
    info = engine.get_server_info()
    return {key: info[key] for key in COUNTERS}


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {key: after[key] - before[key] for key in before}


def _idle(delta: dict[str, Any]) -> float | None:
    total = delta["device_busy_s"] + delta["device_idle_s"]
    return delta["device_idle_s"] / total if total > 0 else None


def timed_generate(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """One batch call: wall time, the engine's counter deltas and the tokens made."""
    before = counters(engine)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=_params(new_tokens))
    wall = time.perf_counter() - start
    delta = _delta(before, counters(engine))
    return {
        "wall_s": wall,
        "output_tokens": sum(len(o["output_ids"]) for o in outs),
        "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
        **delta,
    }


# -- decode step time against the roofline --------------------------------------------------------
def decode_step_time(
    engine: Any, prompts: list[list[int]], steps: int, repeats: int
) -> dict[str, Any]:
    """Device time of one decode step of ``len(prompts)`` requests.

    The engine's timeline sums device busy time but keeps no per-forward times, so two
    runs of the same prompts are differenced: one that stops after the prefill's token
    and one that decodes ``steps`` more. A first run puts the prompts in the radix cache,
    so both runs prefill one token per request and the difference is decode alone (a
    full prefill in both would add its run-to-run jitter to it)."""
    timed_generate(engine, prompts, 3)  # caches the prompts; warms this size's decode
    estimates, counted, cached = [], [], []
    for _ in range(repeats):
        base = timed_generate(engine, prompts, 1)
        full = timed_generate(engine, prompts, 1 + steps)
        decoded = full["decode_steps"] - base["decode_steps"]
        if decoded < 1:
            raise RuntimeError(f"no decode step was counted for batch {len(prompts)}")
        estimates.append((full["device_busy_s"] - base["device_busy_s"]) / decoded)
        counted.append(int(decoded))
        cached.append(full["cached_tokens"] / sum(len(p) for p in prompts))
    return {
        "measured_s": statistics.median(estimates),
        "measured_s_runs": estimates,
        "decode_steps_counted": counted,
        "cached_prompt_fraction": min(cached),
    }


def roofline_row(
    batch: int,
    cuda_graph: bool,
    timing: dict[str, Any],
    *,
    context: int,
    steps: int,
    weights: dict[str, Any],
    kv_per_token: int,
    bandwidth: float,
) -> dict[str, Any]:
    """One batch size: measured against (weights + KV read) / bandwidth.

    Decode step i attends over ``context + i`` tokens, so the KV bytes use the mean
    length over the N measured steps, ``context + (N + 1) / 2``."""
    mean_len = context + (steps + 1) / 2
    kv = batch * mean_len * kv_per_token
    roofline = (weights["bytes_per_step"] + kv) / bandwidth
    return {
        "batch_size": batch,
        "cuda_graph": cuda_graph,
        **timing,
        "mean_kv_len": mean_len,
        "weight_bytes": weights["bytes_per_step"],
        "kv_bytes": kv,
        "roofline_s": roofline,
        "bandwidth_utilisation": roofline / timing["measured_s"],
    }


def sweep(
    engine: Any,
    batches: tuple[int, ...],
    plan: Plan,
    cuda_graph: bool,
    model: dict[str, Any],
    seed: int,
) -> list[dict[str, Any]]:
    """The roofline rows of one engine, smallest batch first. A row says it ran with
    CUDA graphs only if the engine captured a graph for its batch size (a larger batch
    runs eagerly even with graphs on)."""
    vocab = engine.model_config.vocab_size
    captured = max(engine.cuda_graph_batch_sizes or [0])
    rows = []
    for batch in sorted(batches):
        graphed = cuda_graph and batch <= captured
        prompts = random_prompts(vocab, batch, plan.context, (seed, "decode", batch, cuda_graph))
        timing = decode_step_time(engine, prompts, plan.decode_steps, plan.repeats)
        row = roofline_row(
            batch,
            graphed,
            timing,
            context=plan.context,
            steps=plan.decode_steps,
            weights=model["weights"],
            kv_per_token=model["kv_bytes_per_token"],
            bandwidth=model["bandwidth"],
        )
        print(
            f"  decode B={batch:<4d} graph={'on ' if graphed else 'off'} "
            f"{row['measured_s'] * 1e3:8.3f} ms  roofline {row['roofline_s'] * 1e3:8.3f} ms  "
            f"{row['bandwidth_utilisation']:6.1%}",
            flush=True,
        )
        rows.append(row)
    return rows


# -- throughput -----------------------------------------------------------------------------------
def throughput_runs(
    engine: Any, workload: tuple[int, int, int], repeats: int, seed: int, tag: str
) -> dict[str, Any]:
    """``repeats`` runs of one workload, fresh prompts each (so the radix cache never
    helps), the same prompts for every engine; the run with the median output
    throughput is reported, every run's throughput rides along."""
    requests, input_len, output_len = workload
    vocab = engine.model_config.vocab_size
    runs = []
    for r in range(repeats):
        prompts = random_prompts(vocab, requests, input_len, (seed, tag, r))
        run = timed_generate(engine, prompts, output_len)
        run["output_throughput"] = run["output_tokens"] / run["wall_s"]
        run["device_idle_fraction"] = _idle(run)
        runs.append(run)
    return median_run(runs)


def warm_up(engine: Any) -> None:
    """First forwards of a fresh engine: allocator, kernel caches, graph replays."""
    vocab = engine.model_config.vocab_size
    engine.generate(input_ids=random_prompts(vocab, 2, 16, ("warm",)), sampling_params=_params(4))


# -- device idle ----------------------------------------------------------------------------------
def idle_window(
    engine: Any, workload: tuple[int, int, int], seed: int, profile: bool
) -> dict[str, Any]:
    """Device idle fraction over one whole run of the overlap loop, prefill included.

    The profiler starts before the run is submitted (its start takes longer than a short
    run) and records device activity only (no host ops), so it adds little host work to
    the loop it watches; what it adds can only raise the idle figure. The timed
    throughput runs never run under it. The engine timeline's figure covers the same
    run."""
    requests, input_len, output_len = workload
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(vocab, requests, input_len, (seed, "idle"))
    window_steps = max(2, output_len // 2)
    first = counters(engine)
    profiler = _start_profiler() if profile else None
    engine.generate(input_ids=prompts, sampling_params=_params(output_len))
    last = counters(engine)
    trace = _stop_profiler(profiler) if profiler is not None else None
    start = first
    window = _delta(first, last)
    result: dict[str, Any] = {
        "workload": _workload_dict(workload),
        "window_decode_steps": int(window["decode_steps"]),
        "window_complete": window["decode_steps"] >= window_steps,
        "timeline_idle_fraction_window": _idle(window),
        "timeline_idle_fraction_run": _idle(_delta(start, counters(engine))),
        "profiler_idle_fraction": None,
        "profiler": None,
    }
    if trace is not None:
        result["profiler"] = trace
        result["profiler_idle_fraction"] = trace["idle_fraction"]
    elif not profile:
        result["profiler_note"] = "no CUDA device: the engine timeline only"
    return result


def _start_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CUDA])
    profiler.start()
    return profiler


def _stop_profiler(profiler: Any) -> dict[str, Any]:
    """Union of the device's kernel and memcpy/memset intervals over the span from the
    first to the last of them; idle is the rest of that span."""
    profiler.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(path))
        events = json.loads(path.read_text(encoding="utf-8")).get("traceEvents", [])
    intervals = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_TRACE_CATEGORIES
    )
    if not intervals:
        raise RuntimeError("the profiler recorded no device activity in the window")
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for begin, end in intervals[1:]:
        if begin > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = begin, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in intervals) - intervals[0][0]
    return {
        "source": "torch.profiler, CUDA activity: kernels, memcpy and memset",
        "activities": len(intervals),
        "window_s": span / 1e6,
        "busy_s": busy / 1e6,
        "idle_fraction": max(0.0, 1.0 - busy / span) if span > 0 else 0.0,
    }


# -- transformers ---------------------------------------------------------------------------------
def transformers_runs(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    workload: tuple[int, int, int],
    repeats: int,
    seed: int,
) -> dict[str, Any]:
    """transformers' batched greedy ``generate`` over the same prompts as tandem's runs.

    The model is built from the config with random weights, directly on the device (a
    host-side init of an 8B model would take minutes); left padding with an attention
    mask, and ``min_new_tokens`` so every row makes as many tokens as tandem's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    requests, input_len, output_len = workload
    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if next(model.parameters()).dtype != dtype:  # a transformers that predates ``dtype=``
        model = model.to(dtype)
    kwargs = {
        "max_new_tokens": output_len,
        "min_new_tokens": output_len,
        "do_sample": False,
        "pad_token_id": 0,
    }
    runs = []
    with torch.inference_mode():
        warm = random_prompts(config.vocab_size, 2, 16, ("warm",))
        ids, mask = left_padded(warm, 0, device)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
        )
        synchronize(device)
        for r in range(repeats):
            prompts = random_prompts(config.vocab_size, requests, input_len, (seed, "hf", r))
            ids, mask = left_padded(prompts, 0, device)
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            synchronize(device)
            wall = time.perf_counter() - start
            tokens = (out.shape[1] - ids.shape[1]) * len(prompts)
            runs.append(
                {"wall_s": wall, "output_tokens": tokens, "output_throughput": tokens / wall}
            )
    del model
    _free(device)
    return median_run(runs)


# -- one model ------------------------------------------------------------------------------------
def _workload_dict(workload: tuple[int, int, int]) -> dict[str, int]:
    requests, input_len, output_len = workload
    return {"requests": requests, "input_len": input_len, "output_len": output_len}


def _ratio(top: float, bottom: float) -> float:
    if not bottom > 0:
        raise RuntimeError(f"a ratio over {bottom}: a run made no tokens")
    return top / bottom


def bench_model(name: str, args: argparse.Namespace, plan: Plan, argv: list[str]) -> dict[str, Any]:
    """Every section for one model config; engines are built one at a time."""
    started = time.perf_counter()
    path = args.config_dir / name
    device = torch.device(args.device)
    mc = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(args.dtype, mc)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    weights = weight_bytes(mc, dtype_bytes)
    print(f"{name}: {weights['parameters'] / 1e9:.2f}B parameters on {device}", flush=True)

    bandwidth = measure_bandwidth(device, plan.copy_bytes, plan.copy_repeats)
    print(f"  bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    model = {
        "weights": weights,
        "kv_bytes_per_token": kv_bytes_per_token(mc, dtype_bytes),
        "bandwidth": bandwidth["bytes_per_s"],
    }
    cuda = device.type == "cuda"
    ovl, hf = plan.overlap_workload, plan.hf_workload
    decode_tokens = plan.context + plan.decode_steps + 1
    longest = max(decode_tokens, ovl[1] + ovl[2], hf[1] + hf[2], 32) + 8
    longest = min(longest, mc.max_position_embeddings)
    main_rows = max(max(plan.batch_sizes), ovl[0], hf[0])
    main_pool = max(max(plan.batch_sizes) * decode_tokens, ovl[0] * longest, hf[0] * longest)
    main = EngineSpec(True, True, main_rows, longest, main_pool + 64)
    normal = EngineSpec(False, True, ovl[0], longest, ovl[0] * longest + 64)
    eager_pool = max(plan.eager_batch_sizes) * decode_tokens + 64
    eager = EngineSpec(True, False, max(plan.eager_batch_sizes), longest, eager_pool)
    sections: dict[str, Any] = {}

    def on_main(engine: Any) -> None:
        sections["engine_parameters"] = engine_parameters(engine)
        sections["graph_sizes"] = engine.cuda_graph_batch_sizes
        sections["attention_backend"] = getattr(engine, "attention_backend", None)
        sections["rows"] = sweep(engine, plan.batch_sizes, plan, cuda, model, args.seed)
        if not args.skip_transformers:
            warm_up(engine)
            sections["tandem"] = throughput_runs(engine, hf, plan.repeats, args.seed, "hf")
        warm_up(engine)
        sections["overlap"] = throughput_runs(engine, ovl, plan.repeats, args.seed, "ovl")
        sections["idle"] = idle_window(engine, ovl, args.seed, profile=cuda)

    def on_normal(engine: Any) -> None:
        warm_up(engine)
        sections["normal"] = throughput_runs(engine, ovl, plan.repeats, args.seed, "ovl")

    def on_eager(engine: Any) -> None:
        sections["eager_rows"] = sweep(
            engine, plan.eager_batch_sizes, plan, False, model, args.seed
        )

    with_engine(args, path, main, on_main)
    with_engine(args, path, normal, on_normal)
    if cuda:  # elsewhere there are no graphs to turn off: the sweep above is eager already
        with_engine(args, path, eager, on_eager)
    overlap_ratio = _ratio(
        sections["overlap"]["output_throughput"], sections["normal"]["output_throughput"]
    )
    print(f"  overlap / normal output throughput {overlap_ratio:.3f}", flush=True)
    if args.skip_transformers:
        versus: dict[str, Any] = {"skipped": "--skip-transformers"}
    else:
        peer = transformers_runs(path, device, dtype, hf, plan.repeats, args.seed)
        versus = {
            "workload": _workload_dict(hf),
            "tandem": sections["tandem"],
            "transformers": peer,
            "tandem_vs_transformers": _ratio(
                sections["tandem"]["output_throughput"], peer["output_throughput"]
            ),
        }
    return {
        "benchmark": BENCHMARK_ID,
        "schema_version": SCHEMA_VERSION,
        "model": name,
        "config": config_summary(mc, weights),
        "environment": environment(device),
        "command": shlex.join(["python", "tools/bench_gpu.py", *argv]),
        "settings": {
            "dtype": str(dtype).removeprefix("torch."),
            "attention_backend": sections["attention_backend"],
            "cuda_graph_max_bs": args.cuda_graph_max_bs if cuda else None,
            "dummy_weights": "the engine's seeded draw (load_format='dummy'), on the device",
            "quick": args.quick,
            "seed": args.seed,
            "repeats": plan.repeats,
        },
        "bandwidth": bandwidth,
        "decode": {
            "method": STEP_TIME_METHOD,
            "roofline": "(weight bytes + KV bytes) / bandwidth; weights: every parameter "
            "but the input embedding (unless tied), KV: batch x mean KV length x layers x 2 "
            "x kv_heads x head_dim x dtype bytes",
            "context": plan.context,
            "decode_steps": plan.decode_steps,
            "weights": {**weights, "engine_parameters": sections["engine_parameters"]},
            "kv_bytes_per_token": model["kv_bytes_per_token"],
            "cuda_graph_batch_sizes": sections["graph_sizes"],
            "rows": sections["rows"] + sections.get("eager_rows", []),
        },
        "overlap": {
            "workload": _workload_dict(ovl),
            "overlap": sections["overlap"],
            "normal": sections["normal"],
            "overlap_vs_normal": overlap_ratio,
        },
        "idle": sections["idle"],
        "transformers": versus,
        "elapsed_s": time.perf_counter() - started,
    }


# -- report ---------------------------------------------------------------------------------------
def format_report(report: dict[str, Any]) -> str:
    """A compact table of one model's file."""
    bw = report["bandwidth"]["bytes_per_s"]
    weights = report["decode"]["weights"]["bytes_per_step"]
    lines = [
        f"{report['model']} on {report['environment']['device_name']}: bandwidth "
        f"{bw / 1e9:.1f} GB/s, weights read per step {weights / 1e9:.2f} GB",
        f"  {'batch':>5s}  {'graphs':>6s}  {'measured ms':>11s}  {'roofline ms':>11s}  "
        f"{'utilisation':>11s}",
    ]
    for row in report["decode"]["rows"]:
        lines.append(
            f"  {row['batch_size']:5d}  {'on' if row['cuda_graph'] else 'off':>6s}  "
            f"{row['measured_s'] * 1e3:11.3f}  {row['roofline_s'] * 1e3:11.3f}  "
            f"{row['bandwidth_utilisation']:11.1%}"
        )
    ovl, idle = report["overlap"], report["idle"]
    lines.append(
        f"  output tok/s: overlap {ovl['overlap']['output_throughput']:.0f}, normal "
        f"{ovl['normal']['output_throughput']:.0f} (overlap / normal "
        f"{ovl['overlap_vs_normal']:.3f})"
    )
    prof = idle["profiler_idle_fraction"]
    timeline = idle["timeline_idle_fraction_window"]
    lines.append(
        "  device idle (overlap, whole run): profiler "
        + ("-" if prof is None else f"{prof:.2%}")
        + ", timeline "
        + ("-" if timeline is None else f"{timeline:.2%}")
    )
    versus = report["transformers"]
    if "skipped" in versus:
        lines.append(f"  transformers: skipped ({versus['skipped']})")
    else:
        lines.append(
            f"  output tok/s: tandem {versus['tandem']['output_throughput']:.0f}, transformers "
            f"{versus['transformers']['output_throughput']:.0f} (tandem / transformers "
            f"{versus['tandem_vs_transformers']:.2f}x)"
        )
    lines.append(f"  elapsed {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _out_path(template: str, model: str, several: bool) -> Path:
    """Where one model's file goes; the default lands in this checkout wherever the
    script runs from."""
    if template == DEFAULT_OUT:
        template = str(ROOT / DEFAULT_OUT)
    if "{model}" in template:
        return Path(template.replace("{model}", model))
    if several:
        raise ValueError("--out needs a {model} placeholder when several models run")
    return Path(template)


def main(argv: list[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(arguments)
    try:
        plan = make_plan(args)
    except ValueError as exc:
        parser.error(str(exc))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in models:
        if not (args.config_dir / name / "config.json").is_file():
            parser.error(f"argument --models: no {args.config_dir / name / 'config.json'}")
    try:
        outs = {m: _out_path(args.out, m, len(models) > 1) for m in models}
    except ValueError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    reports = []
    for name in models:
        report = bench_model(name, args, plan, arguments)
        outs[name].parent.mkdir(parents=True, exist_ok=True)
        outs[name].write_text(
            json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8"
        )
        print(f"  wrote {outs[name]}", flush=True)
        reports.append(report)
    print()
    for report in reports:
        print(format_report(report))
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
