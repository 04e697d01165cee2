"""``tandem bench serve``: a load generator against any OpenAI-compatible server.

Builds the workload of ``tandem bench``, sends each request as a streamed
``/v1/completions`` (or ``--endpoint chat``: ``/v1/chat/completions``) call with greedy
sampling, a fixed ``max_tokens`` and ``ignore_eos``, at Poisson arrivals
(``--request-rate``) under an optional ``--max-concurrency`` cap, and reports the
figures of SGLang's ``bench_serving``: throughput, TTFT, ITL, TPOT and end-to-end
latency. ``--fairness`` also checks that one heavy client does not slow the others
(``run_fairness``). See docs/guides/benchmarking.md, "Against a server".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.server.bench import offline as bench
from tandem.server.server_config import default_api_key

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_WORDS = ("the", "model", "serves", "tokens", "quickly", "and", "with", "care", "a", "batch")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="tandem bench serve",
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:30000", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--backend",
        default="openai",
        choices=("openai", "tandem", "sglang", "vllm"),
        help="any OpenAI-compatible server; the name is recorded only (default: openai)",
    )
    parser.add_argument(
        "--endpoint", choices=tuple(ENDPOINTS), default="completions", help="(default: completions)"
    )
    parser.add_argument("--model", help="model name sent (default: the first of /v1/models)")
    parser.add_argument(
        "--api-key", help="sent as Authorization: Bearer (default: the TANDEM_API_KEY variable)"
    )
    parser.add_argument(
        "--tokenizer-path",
        help="checkpoint folder or tokenizer.json (default: the served model's, for a tandem "
        "server, else none: prompts are random words and tokens are counted from usage)",
    )
    bench.add_workload_arguments(parser)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals, requests/s; inf sends all at once (default: inf)",
    )
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=1, help="workload and arrival seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    parser.add_argument("--output-json", help="write the figures to this file")
    parser.add_argument(
        "--fairness",
        action="store_true",
        help="run the workload alone, then beside one heavy request; report the ratio of "
        "the plain streams' median TPOT beside it to alone",
    )
    parser.add_argument(
        "--heavy-stop-strings",
        type=int,
        help="the heavy request's stop strings (default: the server's limit, from "
        "/get_server_info, else 4, OpenAI's)",
    )
    parser.add_argument(
        "--heavy-stop-length",
        type=int,
        help="characters of each (default: the server's limit, else 64)",
    )
    return parser


# -- server and tokenizer -------------------------------------------------------------------------
async def _get_json(client: Any, url: str) -> Any:
    async with client.get(url) as response:
        response.raise_for_status()
        return await response.json(content_type=None)


async def _models(client: Any, base_url: str) -> list[dict[str, Any]]:
    return list((await _get_json(client, f"{base_url}/v1/models")).get("data") or [])


async def _tandem_tokenizer(client: Any, base_url: str, model: str) -> Any:
    """The served model's tokenizer: from its folder when the server shows it (to a
    caller with its API key) and it is readable here; else from the served name
    ``model`` resolved as ``tandem serve --model-path`` resolves it (``default``: the
    default model, fetched once if need be; ``tandem-tiny``, a folder, a Hub id); None
    when the name is none of these (``--served-model-name``)."""
    from tokenizers import Tokenizer

    try:
        info = await _get_json(client, f"{base_url}/get_server_info")
        folder = info.get("tokenizer_path") or info.get("model_path")
        path = Path(str(folder)) / "tokenizer.json"
        if folder and path.is_file():
            return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - resolve the served name instead
        pass
    from tandem.scheduler.models.source import resolve_model, resolve_tokenizer

    try:
        if model == "default":  # tandem serve's name for its default model
            folder = resolve_model(None)
        else:
            folder = resolve_tokenizer(model, Path(model))
    except (ValueError, OSError, RuntimeError):
        return None
    path = folder / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    return Tokenizer.from_file(str(file))


def _word_workload(args: argparse.Namespace) -> bench.Workload:
    """Without a tokenizer: random words, one word per intended token (roughly)."""
    return bench.build_workload(args, len(_WORDS), None, 1 << 62)


# -- requests -------------------------------------------------------------------------------------
@dataclass
class Output:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def _body(args: argparse.Namespace, model: str, prompt: Any, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _has_text(choice: dict[str, Any], chat: bool) -> bool:
    if chat:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


async def send(client: Any, url: str, body: dict[str, Any], prompt_len: int) -> Output:
    out = Output(prompt_len=prompt_len)
    chat = "messages" in body
    chunks = 0
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return out
            # Server-sent events, one line at a time; only ``data:`` lines carry chunks.
            async for raw in response.content:
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"])[:200]
                    return out
                if event.get("usage"):
                    usage = event["usage"]
                if not any(_has_text(c, chat) for c in event.get("choices") or []):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    out.output_len = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        out.prompt_len = int(usage["prompt_tokens"])
    out.success = chunks > 0 or out.output_len == 0
    if not out.success:
        out.error = "no token streamed"
    return out


async def _arrivals(n: int, rate: float, rng: random.Random) -> Any:
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(
    args: argparse.Namespace, client: Any, model: str, prompts: list[Any], work: bench.Workload
) -> tuple[list[Output], float]:
    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(i: int) -> Output:
        body = _body(args, model, prompts[i], work.output_lens[i])
        if limit is None:
            return await send(client, url, body, len(work.prompts[i]))
        async with limit:
            return await send(client, url, body, len(work.prompts[i]))

    tasks = []
    start = time.perf_counter()
    async for i in _arrivals(len(prompts), args.request_rate, random.Random(args.seed)):
        tasks.append(asyncio.create_task(one(i)))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start


_SPEC_COUNTERS = ("tandem_spec_verify_steps_total", "tandem_spec_committed_tokens_total")


async def _spec_counters(client: Any, base_url: str) -> tuple[int, int] | None:
    """A tandem server's speculative verify steps and committed tokens so far, from its
    ``/metrics``; None from another server."""
    try:
        async with client.get(f"{base_url}/metrics") as response:
            text = await response.text() if response.status == 200 else ""
    except Exception:  # noqa: BLE001 - no metrics: not a tandem server
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _SPEC_COUNTERS:
            values[name] = int(float(value))
    if len(values) != len(_SPEC_COUNTERS):
        return None
    return values[_SPEC_COUNTERS[0]], values[_SPEC_COUNTERS[1]]


async def _settled_counters(client: Any, base_url: str) -> tuple[int, int] | None:
    """The counters once the server's figures have caught up with the run: a tandem
    server refreshes them a few times a second, so read until two reads 0.3 s apart
    agree (at most ten)."""
    last = await _spec_counters(client, base_url)
    for _ in range(10):
        await asyncio.sleep(0.3)
        now = await _spec_counters(client, base_url)
        if now == last:
            break
        last = now
    return last


def _accept_length(
    before: tuple[int, int] | None, after: tuple[int, int] | None
) -> dict[str, float]:
    """The run's mean accept length (tokens committed per verify step, bonus included)
    from the counters around it; nothing when the server does not speculate."""
    if before is None or after is None or after[0] <= before[0]:
        return {}
    steps = after[0] - before[0]
    return {"spec_verify_steps": steps, "spec_accept_length": (after[1] - before[1]) / steps}


# -- fairness -------------------------------------------------------------------------------------
HEAVY_TOP_LOGPROBS = 20  # OpenAI's most


async def heavy_body(
    args: argparse.Namespace, client: Any, base_url: str, model: str, context: int
) -> dict[str, Any]:
    """One request as heavy as the server's limits allow: its stop strings (never
    matched: each is a number and then ``~``s), the most top logprobs, and enough
    tokens to outlast the plain streams (it is cancelled when they end)."""
    count, length = args.heavy_stop_strings, args.heavy_stop_length
    if count is None or length is None:
        try:
            info = await _get_json(client, f"{base_url}/get_server_info")
        except Exception:  # noqa: BLE001 - not a tandem server: OpenAI's bounds
            info = {}
        count = count or int(info.get("max_stop_strings") or 4)
        length = length or int(info.get("max_stop_string_length") or 64)
    stops = [f"{i:06d}".ljust(length, "~")[:length] for i in range(count)]
    return {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max(1, min(context - 64, 1 << 20)),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stop": stops,
        "logprobs": HEAVY_TOP_LOGPROBS,
    }


async def hold_heavy(client: Any, url: str, body: dict[str, Any], running: asyncio.Event) -> str:
    """Stream ``body`` until cancelled; ``running`` is set at its first token. Returns
    why it ended by itself (an error, or that it finished before the plain streams)."""
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {(await response.read())[:300]!r}"
            async for raw in response.content:
                if raw.startswith(b"data:") and not running.is_set():
                    running.set()
        return "the heavy request ended before the plain streams did"
    finally:
        running.set()


async def run_fairness(
    args: argparse.Namespace,
    client: Any,
    model: str,
    prompts: list[Any],
    work: bench.Workload,
    context: int,
) -> dict[str, Any]:
    """The workload alone, then beside the heavy request; the plain streams' figures
    of both runs and the ratio of their median TPOTs.

    The heavy request carries the most and longest stop strings and the most top
    logprobs the server allows; the ratio says how much the plain streams' TPOT grows
    beside it: one client's parameters should never slow the others."""
    base = args.base_url.rstrip("/")
    warm = prompts[: args.max_concurrency or len(prompts)]  # a first batch, not measured
    await run_benchmark(args, client, model, warm, work)
    alone = calculate_metrics(*await run_benchmark(args, client, model, prompts, work))
    body = await heavy_body(args, client, base, model, context)
    running = asyncio.Event()
    heavy = asyncio.create_task(hold_heavy(client, base + ENDPOINTS["completions"], body, running))
    await running.wait()
    if heavy.done():
        raise RuntimeError(f"the heavy request failed: {heavy.result()}")
    beside = calculate_metrics(*await run_benchmark(args, client, model, prompts, work))
    if heavy.done():
        raise RuntimeError(f"the heavy request did not last: {heavy.result()}")
    heavy.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await heavy
    ratio = None
    if alone["median_tpot_ms"] and beside["median_tpot_ms"] is not None:
        ratio = beside["median_tpot_ms"] / alone["median_tpot_ms"]
    return {
        "alone": alone,
        "beside": beside,
        "heavy": {
            "stop_strings": len(body["stop"]),
            "stop_string_length": len(body["stop"][0]),
            "top_logprobs": body["logprobs"],
        },
        "tpot_ratio": ratio,
    }


# -- metrics --------------------------------------------------------------------------------------
def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    stats = bench._percentiles(values)
    return {
        f"mean_{name}_ms": stats["mean"],
        f"median_{name}_ms": stats["p50"],
        f"p99_{name}_ms": stats["p99"],
    }


def calculate_metrics(outputs: list[Output], duration: float) -> dict[str, Any]:
    done = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_len for o in done)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]
    latencies = [o.latency for o in done]
    return {
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "errors": sorted({o.error for o in outputs if not o.success})[:5],
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "output_lens": [o.output_len for o in outputs],
        "request_throughput": len(done) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(latencies) / duration,
        **_stats("ttft", [o.ttft for o in done]),
        **_stats("itl", [x for o in done for x in o.itl]),
        **_stats("tpot", tpots),
        **_stats("e2e_latency", latencies),
    }


_LATENCIES = (("e2e_latency", "E2E Latency"), ("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
_ROWS = (
    ("completed", "Successful requests", "{}"),
    ("failed", "Failed requests", "{}"),
    ("duration_s", "Benchmark duration (s)", "{:.2f}"),
    ("total_input_tokens", "Total input tokens", "{}"),
    ("total_output_tokens", "Total generated tokens", "{}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("input_throughput", "Input token throughput (tok/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("concurrency", "Concurrency", "{:.2f}"),
    ("spec_accept_length", "Speculative accept length", "{:.2f}"),
    *(
        (f"{stat}_{name}_ms", f"{stat.capitalize()} {label} (ms)", "{:.2f}")
        for name, label in _LATENCIES
        for stat in ("mean", "median", "p99")
    ),
)


def format_report(result: dict[str, Any]) -> str:
    lines = []
    for key, label, fmt in _ROWS:
        value = result.get(key)
        lines.append(f"{label:<40s}{'-' if value is None else fmt.format(value):>12s}")
    return "\n".join(lines)


# -- entry point ----------------------------------------------------------------------------------
async def _main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    import aiohttp

    base = args.base_url.rstrip("/")
    key = args.api_key or default_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # No cap on connections (--max-concurrency is the cap) and no proxies from the
    # environment (aiohttp's trust_env is off by default). A connection per request: a
    # kept-alive one that the server has closed meanwhile (llama-server does) fails the
    # next request written to it.
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=args.timeout),
        headers=headers,
    ) as client:
        try:
            models = await _models(client, base)
        except (aiohttp.ClientError, ValueError) as exc:
            parser.error(f"argument --base-url: cannot list models at {base}: {exc}")
        if not args.model and not models:
            parser.error("argument --model: the server lists no model")
        model = args.model or str(models[0]["id"])
        entry = next((m for m in models if m.get("id") == model), {})
        tokenizer = None
        if args.tokenizer_path:
            tokenizer = load_tokenizer(args.tokenizer_path)
        elif entry.get("owned_by") == "tandem":
            tokenizer = await _tandem_tokenizer(client, base, model)
        context = int(entry.get("max_model_len") or 1 << 62)
        try:
            if tokenizer is None:
                if args.workload == "sharegpt":
                    parser.error("argument --tokenizer-path: required by --workload sharegpt")
                work = _word_workload(args)
            else:
                work = bench.build_workload(args, tokenizer.get_vocab_size(), tokenizer, context)
        except ValueError as exc:
            parser.error(str(exc))
        if tokenizer is None:
            texts = [" ".join(_WORDS[t] for t in p) for p in work.prompts]
            prompts: list[Any] = texts
        elif args.endpoint == "chat":
            prompts = [tokenizer.decode(p) for p in work.prompts]
        else:
            prompts = work.prompts
        print(
            f"{args.backend} {base}{ENDPOINTS[args.endpoint]} model {model}: workload "
            f"{args.workload}, {len(prompts)} requests, rate {args.request_rate}, "
            f"max concurrency {args.max_concurrency or '-'}",
            file=sys.stderr,
        )
        if args.fairness:
            try:
                fairness = await run_fairness(args, client, model, prompts, work, context)
            except RuntimeError as exc:
                parser.exit(1, f"tandem bench serve: error: {exc}\n")
            result = {**fairness["beside"], "fairness": fairness}
        else:
            before = await _spec_counters(client, base)
            result = calculate_metrics(*await run_benchmark(args, client, model, prompts, work))
            result.update(_accept_length(before, await _settled_counters(client, base)))
    result.update(
        backend=args.backend,
        endpoint=args.endpoint,
        model=model,
        workload=args.workload,
        num_prompts=len(prompts),
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        requested_output_lens=work.output_lens,
    )
    return result


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.num_prompts < 1:
        parser.error("argument --num-prompts: must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("argument --random-range-ratio: must be in [0, 1]")
    if not args.request_rate > 0:
        parser.error("argument --request-rate: must be positive (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("argument --max-concurrency: must be at least 1")
    for name in ("heavy_stop_strings", "heavy_stop_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    if args.workload == "sharegpt" and not args.dataset_path:
        parser.error("argument --dataset-path: required by --workload sharegpt")
    if args.apply_chat_template:
        parser.error(
            "argument --apply-chat-template: tandem bench serve renders chat prompts in the "
            "server; use --endpoint chat"
        )
    result = asyncio.run(_main(args, parser))
    if "fairness" in result:
        fair = result["fairness"]
        print("Alone\n" + format_report(fair["alone"]))
        print("\nBeside one heavy request " + json.dumps(fair["heavy"]))
        print(format_report(fair["beside"]))
        ratio = fair["tpot_ratio"]
        print(f"{'Median TPOT beside / alone':<40s}{'-' if ratio is None else f'{ratio:.2f}':>12s}")
    else:
        print(format_report(result))
    if args.output_json:
        out = {k: (None if v == float("inf") else v) for k, v in result.items()}
        out["request_rate"] = "inf" if args.request_rate == float("inf") else args.request_rate
        Path(args.output_json).write_text(json.dumps(out, indent=2) + "\n")
    failed = result["failed"] + result.get("fairness", {}).get("alone", {}).get("failed", 0)
    return 0 if failed == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return run(parser.parse_args(argv), parser)
