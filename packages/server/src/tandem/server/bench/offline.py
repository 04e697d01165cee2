"""``tandem bench``: an offline, in-process benchmark of the engine.

Builds a workload (random, shared-prefix or ShareGPT), submits every request at once to
an in-process ``Engine`` as one batch call (greedy, ``ignore_eos``, a fixed
``max_new_tokens`` per request), and times each request's tokens as they reach the
engine's host side (``return_token_times``), or with ``--stream`` as a streaming reader
sees them. ``--compare-overlap`` and ``--compare-transformers`` add variants; each runs
``--repeats`` times, interleaved, and the median run by output throughput is reported.
See docs/guides/benchmarking.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "shared-prefix", "sharegpt", "text")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    constrained: frozenset[int] = frozenset()
    """Requests whose output a grammar constrains (``--constrained-fraction``)."""

    @property
    def total_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options, shared with ``tandem bench serve`` (SGLang's names)."""
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument(
        "--dataset-path",
        help="ShareGPT-format JSON (--workload sharegpt) or a plain text file (--workload "
        "text: prompts are --random-input-len token windows of it at seeded offsets)",
    )
    parser.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="--workload sharegpt: send each human turn as a one-turn chat, rendered with "
        "the model's chat template (tandem bench; tandem bench serve's --endpoint chat "
        "renders it in the server)",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    parser.add_argument("--random-input-len", type=int, default=256, help="(default: 256)")
    parser.add_argument("--random-output-len", type=int, default=128, help="(default: 128)")
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly in [len * ratio, len] (default: 0.0)",
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=128,
        help="common prefix of every prompt, for --workload shared-prefix (default: 128)",
    )


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine holds and multiplies the weights, as `tandem serve` takes it."""
    parser.add_argument(
        "--quantization",
        help="gguf, int8 or none, as `tandem serve --quantization` (default: the engine's)",
    )
    parser.add_argument(
        "--cpu-int8-activations",
        action="store_true",
        help="the quantized products round x to one 8-bit part, as llama.cpp does",
    )


def weights_options(args: argparse.Namespace) -> dict[str, Any]:
    """``add_weights_arguments``' options as ``Engine`` keywords (the engine's default
    where one is not given)."""
    options: dict[str, Any] = {"cpu_int8_activations": args.cpu_int8_activations}
    if args.quantization is not None:
        options["quantization"] = args.quantization
    return options


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    if parser is None:
        parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__)
    parser.add_argument(
        "--model-path",
        help="model folder, GGUF file, Hugging Face id, or tandem-tiny (the tiny test "
        "model); default: the default model, as `tandem serve`'s",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="model dtype (default: auto)")
    add_weights_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default: 1)")
    parser.add_argument(
        "--max-running-requests",
        type=int,
        help="requests decoding at once (default: the engine's); raise it with "
        "--num-prompts to decode a larger batch",
    )
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="run the normal and the overlap loop in one process, alternating",
    )
    parser.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also run the workload through Hugging Face transformers' batched generate",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each variant, interleaved; the run with the median output "
        "throughput is reported (default: 3)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="read each request as a stream in this process and time the chunks' "
        "arrivals (default: one batch call, with the engine's per-token times)",
    )
    parser.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="fraction of the requests whose output a regex constrains, spread evenly: "
        "the grammar masks' cost, and the device idle time they add (default: 0)",
    )
    parser.add_argument("--output-json", help="write the figures to this file")
    add_speculative_arguments(parser)
    return parser


SPECULATIVE_OPTIONS = (
    ("speculative_algorithm", str, "EAGLE or EAGLE3: benchmark speculative decoding"),
    ("speculative_draft_model_path", str, "the draft head's folder"),
    ("speculative_num_steps", int, "draft forwards per step"),
    ("speculative_eagle_topk", int, "branching of the draft tree (1: a chain)"),
    ("speculative_num_draft_tokens", int, "tokens verified per step"),
    (
        "speculative_disable_by_batch_size",
        int,
        "turn speculation off while this many requests or more decode in one step",
    ),
    (
        "speculative_disable_adaptive",
        bool,
        "keep drafting where the measured step times say it loses",
    ),
)


def speculative_options(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative options given, as ``Engine`` keywords."""
    given = {name: getattr(args, name) for name, _, _ in SPECULATIVE_OPTIONS}
    return {name: value for name, value in given.items() if value is not None}


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """The Engine's speculative options, and ``--compare-speculative``."""
    for name, kind, text in SPECULATIVE_OPTIONS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=text)
        else:
            parser.add_argument(flag, type=kind, help=text)
    parser.add_argument(
        "--compare-speculative",
        action="store_true",
        help="also run the same engine without speculative decoding, alternating, and "
        "report the speedup",
    )


# -- workloads ------------------------------------------------------------------------------------
def _lens(rng: random.Random, length: int, ratio: float, n: int) -> list[int]:
    low = max(1, int(length * ratio))
    high = max(low, length)
    return [rng.randint(low, high) for _ in range(n)]


def _random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def build_workload(args: argparse.Namespace, vocab: int, tokenizer: Any, context: int) -> Workload:
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.workload == "sharegpt":
        return _sharegpt(args, tokenizer, context)
    if args.workload == "text":
        return _text(args, tokenizer, rng)
    in_lens = _lens(rng, args.random_input_len, args.random_range_ratio, n)
    out_lens = _lens(rng, args.random_output_len, args.random_range_ratio, n)
    prefix: list[int] = []
    if args.workload == "shared-prefix":
        prefix = _random_ids(rng, vocab, args.shared_prefix_len)
    prompts = [prefix + _random_ids(rng, vocab, k) for k in in_lens]
    for i, prompt in enumerate(prompts):
        if len(prompt) + out_lens[i] > context:
            raise ValueError(
                f"prompt {len(prompt)} + output {out_lens[i]} tokens exceed the "
                f"context length ({context})"
            )
    return Workload(prompts, out_lens)


def _sharegpt(args: argparse.Namespace, tokenizer: Any, context: int) -> Workload:
    if not args.dataset_path:
        raise ValueError("--workload sharegpt needs --dataset-path")
    if tokenizer is None:
        raise ValueError("--workload sharegpt needs a checkpoint with a tokenizer.json")
    data = json.loads(Path(args.dataset_path).read_text())
    rng = random.Random(args.seed)
    rng.shuffle(data)
    prompts, out_lens = [], []
    for item in data:
        turns = item.get("conversations") or []
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        gpt = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if human is None or gpt is None:
            continue
        if args.apply_chat_template:
            human = tokenizer.apply_chat_template([{"role": "user", "content": human}])
        prompt = _encode(tokenizer, human)
        out_len = len(_encode(tokenizer, gpt))
        if not prompt or out_len < 1 or len(prompt) + out_len > context:
            continue
        prompts.append(prompt)
        out_lens.append(out_len)
        if len(prompts) == args.num_prompts:
            break
    if not prompts:
        raise ValueError(f"no usable conversation in {args.dataset_path}")
    return Workload(prompts, out_lens)


def _text(args: argparse.Namespace, tokenizer: Any, rng: random.Random) -> Workload:
    """Windows of a text file: natural prompts, where a trained draft head is tested."""
    if tokenizer is None:
        raise ValueError("--workload text needs a model with a tokenizer")
    ids = _encode(tokenizer, Path(args.dataset_path).read_text(encoding="utf-8"))
    size = args.random_input_len
    if len(ids) <= size:
        raise ValueError(f"{args.dataset_path} holds {len(ids)} tokens, fewer than one prompt")
    starts = [rng.randrange(len(ids) - size) for _ in range(args.num_prompts)]
    return Workload([ids[i : i + size] for i in starts], [args.random_output_len] * len(starts))


def _tokenizer(engine: Any) -> Any:
    """The checkpoint's tokenizer (the engines keep none), or None without one."""
    from tandem.scheduler.text.tokenizer import Tokenizer

    path = Path(engine.config.tokenizer_path or engine.model_path)
    return Tokenizer.from_pretrained(path) if (path / "tokenizer.json").exists() else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without special tokens, from tandem's or the ``tokenizers`` tokenizer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(ids, "ids", ids))


# -- measurement ----------------------------------------------------------------------------------
def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    import numpy as np

    arr = np.asarray(values, dtype=float) * 1000.0
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
    }


def _latency_fields(name: str, values: Sequence[float] | None) -> dict[str, float | None]:
    stats = _percentiles(values or [])
    return {f"{stat}_{name}_ms": value for stat, value in stats.items()}


def _progress(total: int, desc: str) -> Any:
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req")


def _sampling(workload: Workload, i: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": workload.output_lens[i],
        "temperature": 0,
        "ignore_eos": True,
    }
    if i in workload.constrained:
        # Lowercase letters and spaces, too many to end before max_new_tokens (no token
        # spells 16 characters): the request runs its full length, masked at every step.
        params["regex"] = f"[a-z ]{{{16 * workload.output_lens[i]}}}"
    return params


def constrained_indices(n: int, fraction: float) -> frozenset[int]:
    """``fraction`` of ``n`` requests, spread evenly (0.5: every other one)."""
    return frozenset(i for i in range(n) if int((i + 1) * fraction) > int(i * fraction))


def run_engine(engine: Any, workload: Workload, desc: str, stream: bool = False) -> dict[str, Any]:
    """Run ``workload`` through ``engine`` once: as one batch call timed by the engine's
    per-token times, or with ``stream`` as streams (see the module docstring)."""
    if stream:
        return _run_streams(engine, workload, desc)
    n = len(workload.prompts)
    before = engine.get_server_info()
    start = time.perf_counter()
    try:
        results = engine.generate(
            input_ids=workload.prompts,
            sampling_params=[_sampling(workload, i) for i in range(n)],
            return_token_times=True,
        )
    except Exception as exc:
        raise RuntimeError("a benchmark request failed") from exc
    duration = time.perf_counter() - start
    # Every request was submitted at ``start``; its tokens' times are the engine's, one
    # time per step (several tokens share one after a speculative step).
    arrivals = [_grouped(r["meta_info"]["output_token_times"]) for r in results]
    return _engine_result(engine, workload, duration, before, start, arrivals)


def _grouped(times: Sequence[float]) -> list[tuple[float, int]]:
    """Token times as arrivals: ``(time, tokens)`` per distinct consecutive time."""
    return [(t, len(list(group))) for t, group in itertools.groupby(times)]


def _run_streams(engine: Any, workload: Workload, desc: str) -> dict[str, Any]:
    """Submit every request at once and stream them all on one asyncio loop, as an
    API process would: per-request threads would compete with the engine's own
    threads for the interpreter and slow down what they measure."""
    n = len(workload.prompts)
    starts = [0.0] * n
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    bar = _progress(n, desc)
    before = engine.get_server_info()

    async def one(i: int) -> None:
        starts[i] = time.perf_counter()
        chunks = await engine.async_generate(
            input_ids=workload.prompts[i], sampling_params=_sampling(workload, i), stream=True
        )
        async for chunk in chunks:
            arrivals[i].append((time.perf_counter(), len(chunk["output_ids"])))
        if bar is not None:
            bar.update(1)

    async def run_all() -> None:
        await asyncio.gather(*(one(i) for i in range(n)))

    start = time.perf_counter()
    try:
        asyncio.run(run_all())
    except Exception as exc:
        raise RuntimeError("a benchmark request failed") from exc
    finally:
        if bar is not None:
            bar.close()
    duration = time.perf_counter() - start
    chunks = [[(t, k) for t, k in request if k > 0] for request in arrivals]
    return _engine_result(engine, workload, duration, before, starts, chunks)


def _engine_result(
    engine: Any,
    workload: Workload,
    duration: float,
    before: dict[str, Any],
    starts: float | Sequence[float],
    arrivals: Sequence[Sequence[tuple[float, int]]],
) -> dict[str, Any]:
    """The figures of one run from each request's submit time (one for all, or one
    each) and its arrivals: ``(time, tokens)`` when some of its output tokens arrived.
    An arrival of ``k`` tokens counts ``k`` inter-token latencies of ``gap / k``."""
    after = engine.get_server_info()
    verify = after["spec_verify_steps"] - before["spec_verify_steps"]
    committed = after["spec_committed_tokens"] - before["spec_committed_tokens"]
    ttfts, itls, tpots, out_tokens = [], [], [], []
    for i, chunks in enumerate(arrivals):
        tokens = sum(k for _, k in chunks)
        out_tokens.append(tokens)
        if not chunks:
            continue
        start = starts if isinstance(starts, float) else starts[i]
        ttfts.append(chunks[0][0] - start)
        for (prev, _), (now, k) in itertools.pairwise(chunks):
            itls.extend([(now - prev) / k] * k)
        if tokens > 1:
            tpots.append((chunks[-1][0] - chunks[0][0]) / (tokens - 1))
    busy = after["device_busy_s"] - before["device_busy_s"]
    idle = after["device_idle_s"] - before["device_idle_s"]
    decode_steps = after["decode_steps"] - before["decode_steps"]
    decode_host_s = after["decode_scheduler_s"] - before["decode_scheduler_s"]
    result = _result(
        workload,
        duration,
        out_tokens,
        ttfts,
        itls,
        tpots,
        idle / (busy + idle) if busy + idle > 0 else 0.0,
        after["overshoot_steps"] - before["overshoot_steps"],
        decode_host_s * 1e6 / decode_steps if decode_steps else None,
    )
    if verify:
        result["spec_verify_steps"] = verify
        result["spec_accept_length"] = committed / verify
    return result


def _result(
    workload: Workload,
    duration: float,
    out_tokens: list[int],
    ttfts: list[float] | None,
    itls: list[float] | None,
    tpots: list[float],
    idle_fraction: float | None,
    overshoot: int | None,
    host_us_per_decode_step: float | None = None,
) -> dict[str, Any]:
    total_out = sum(out_tokens)
    return {
        "num_requests": len(workload.prompts),
        "duration_s": duration,
        "total_input_tokens": workload.total_input_tokens,
        "total_output_tokens": total_out,
        "output_lens": out_tokens,
        "request_throughput": len(workload.prompts) / duration,
        "input_throughput": workload.total_input_tokens / duration,
        "output_throughput": total_out / duration,
        **_latency_fields("ttft", ttfts),
        **_latency_fields("itl", itls),
        **_latency_fields("tpot", tpots),
        "device_idle_fraction": idle_fraction,
        "overshoot_steps": overshoot,
        "host_us_per_decode_step": host_us_per_decode_step,
    }


def run_transformers(
    path: Path, device: Any, dtype: Any, workload: Workload, repeats: int = 1
) -> list[dict[str, Any]]:
    """``repeats`` runs of one left-padded, greedy batch of the whole workload; every
    row decodes the longest requested length and each request counts its own
    requested tokens."""
    import torch

    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SystemExit(
            "--compare-transformers needs the 'transformers' package: "
            "pip install 'tandem-server[transformers]'"
        ) from None

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id
    if pad is None:
        eos = model.config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) or 0
    ids, mask = left_padded(workload.prompts, pad, device)
    width = ids.shape[1]
    new = max(workload.output_lens)
    kwargs = {
        "max_new_tokens": new,
        "min_new_tokens": new,
        "do_sample": False,
        "pad_token_id": pad,
    }
    with torch.inference_mode():
        warm = {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], **warm)
        synchronize(device)
        results = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            synchronize(device)
            duration = time.perf_counter() - start
            generated = out.shape[1] - width
            out_tokens = [min(k, generated) for k in workload.output_lens]
            tpot = duration / max(1, new)
            results.append(_result(workload, duration, out_tokens, None, None, [tpot], None, None))
    del model
    return results


def left_padded(prompts: Sequence[Sequence[int]], pad: int, device: Any) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` of a batch padded on the left with ``pad``, the
    layout transformers' batched ``generate`` wants for decoder-only models."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def median_run(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output throughput (the lower middle one of an even
    count), so every figure reported comes from one real run; all runs' throughputs
    ride along as ``output_throughput_runs``."""
    ordered = sorted(results, key=lambda r: r["output_throughput"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["output_throughput_runs"] = [r["output_throughput"] for r in results]
    return chosen


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU), before reading a clock."""
    import torch

    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


# -- report ---------------------------------------------------------------------------------------
_ROWS = (
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("request_throughput", "requests/s", "{:.2f}"),
    ("input_throughput", "input tok/s", "{:.1f}"),
    ("total_output_tokens", "output tokens", "{}"),
    ("duration_s", "duration (s)", "{:.3f}"),
    ("mean_ttft_ms", "TTFT mean (ms)", "{:.2f}"),
    ("p50_ttft_ms", "TTFT p50 (ms)", "{:.2f}"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "{:.2f}"),
    ("mean_itl_ms", "ITL mean (ms)", "{:.2f}"),
    ("p50_itl_ms", "ITL p50 (ms)", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 (ms)", "{:.2f}"),
    ("mean_tpot_ms", "TPOT mean (ms)", "{:.2f}"),
    ("p50_tpot_ms", "TPOT p50 (ms)", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 (ms)", "{:.2f}"),
    ("device_idle_fraction", "device idle", "{:.1%}"),
    ("overshoot_steps", "overshoot steps", "{}"),
    ("host_us_per_decode_step", "decode host (us)", "{:.0f}"),
    ("spec_accept_length", "accept length", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
)


def format_table(report: dict[str, dict[str, Any]]) -> str:
    names = list(report)
    lines = [f"{'':18s}" + "".join(f"{n:>15s}" for n in names)]
    for key, label, fmt in _ROWS:
        cells = []
        for name in names:
            value = report[name].get(key)
            cells.append(f"{'-' if value is None else fmt.format(value):>15s}")
        lines.append(f"{label:18s}" + "".join(cells))
    return "\n".join(lines)


# -- entry point ----------------------------------------------------------------------------------
def run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
) -> int:
    from tandem.scheduler import Engine

    if args.num_prompts < 1:
        parser.error("argument --num-prompts: must be at least 1")
    if args.repeats < 1:
        parser.error("argument --repeats: must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("argument --random-range-ratio: must be in [0, 1]")
    if not 0.0 <= args.constrained_fraction <= 1.0:
        parser.error("argument --constrained-fraction: must be in [0, 1]")
    if args.workload in ("sharegpt", "text") and not args.dataset_path:
        parser.error(f"argument --dataset-path: required by --workload {args.workload}")
    spec = speculative_options(args)
    if args.compare_speculative and not spec:
        parser.error("argument --compare-speculative: needs --speculative-algorithm")
    if args.compare_speculative and args.compare_overlap:
        parser.error("argument --compare-speculative: not with --compare-overlap")
    from tandem.server.cli import resolve_models

    args.model_path = resolve_models(parser, {"model_path": args.model_path})["model_path"]

    options: dict[str, Any] = {
        "model_path": args.model_path,
        "device": args.device,
        "dtype": args.dtype,
        **weights_options(args),
    }
    if args.max_running_requests is not None:
        options["max_running_requests"] = args.max_running_requests
    variants: list[tuple[str | None, dict[str, Any]]] = [(None, spec)]
    if args.compare_overlap:
        variants = [
            ("normal", {**spec, "disable_overlap_schedule": True}),
            ("overlap", spec),
        ]
    elif args.compare_speculative:
        variants = [("plain", {}), ("speculative", spec)]
    engines: dict[str, Any] = {}
    try:
        for name, extra in variants:
            try:
                # No detokenizing: the figures are the engine's, as behind a server,
                # whose API process turns ids into text (and transformers makes none).
                # The batch call shows the engine's own progress bar; streams show ours.
                engine = Engine(
                    **options, disable_progress_bar=args.stream, skip_tokenizer_init=True, **extra
                )
            except ValueError as exc:
                parser.error(str(exc))
            engines[name or ("overlap" if engine.scheduler.overlap else "normal")] = engine
        first = next(iter(engines.values()))
        try:
            workload = build_workload(
                args, first.model_config.vocab_size, _tokenizer(first), first.context_length
            )
        except ValueError as exc:
            parser.error(str(exc))
        workload.constrained = constrained_indices(len(workload.prompts), args.constrained_fraction)
        warm = Workload(workload.prompts[:2], [min(4, k) for k in workload.output_lens[:2]])
        for engine in engines.values():
            run_engine(engine, warm, "warm-up", args.stream)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name, engine in engines.items():
                runs[name].append(run_engine(engine, workload, name, args.stream))
        model_path, device, dtype = first.model_path, first.device, first.dtype
    finally:
        for engine in engines.values():
            engine.shutdown()
    if args.compare_transformers:
        runs["transformers"] = run_transformers(model_path, device, dtype, workload, args.repeats)
    report = {name: median_run(results) for name, results in runs.items()}
    if args.compare_speculative:
        base = report["plain"]["output_throughput"]
        report["speculative"]["speedup"] = report["speculative"]["output_throughput"] / base

    print(
        f"workload {args.workload}: {len(workload.prompts)} requests, "
        f"{workload.total_input_tokens} input / {workload.total_output_tokens} output tokens, "
        f"device {device}, dtype {str(dtype).removeprefix('torch.')}"
    )
    print(format_table(report))
    if args.output_json:
        # The command line rides along so a results file says how to reproduce it.
        command = shlex.join(["tandem", "bench", *(argv or [])])
        document = {**report, "command": command}
        Path(args.output_json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    return run(parser.parse_args(argv), parser, argv)
