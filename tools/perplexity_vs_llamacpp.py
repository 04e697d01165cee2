#!/usr/bin/env python3
"""tandem's perplexity and llama.cpp's on the same GGUF file and the same text.

``llama-perplexity -c N`` cuts the text's tokens into K chunks of N (``--chunks K``, the
rest of the text unread), runs each chunk alone and scores only its second half: the
tokens at positions N/2 + 1 to N - 1 of the chunk, each given every token before it in
the chunk (N/2 - 1 tokens a chunk; the chunk's first token becomes BOS when the
vocabulary adds one, which SmolLM2's does not). Its figure is ``exp`` of the mean
negative log-likelihood over those tokens, with an error bar.

tandem is scored twice on the same file and text:

- **the same tokens**: tandem's engine, in this process, scores llama.cpp's own tokens
  of the text (read from ``llama-server``'s ``/tokenize``) chunk by chunk with exactly
  those positions scored (its prompt logprobs from position N/2 + 1); so the two
  figures differ only by the engines' arithmetic (tandem multiplies the file's blocks
  with activations in two 8-bit parts, its default on a CPU; llama.cpp multiplies them
  with activations quantized to 8 bits, and keeps its KV cache in float16; with
  ``--cpu-int8-activations`` tandem rounds them to one 8-bit part as well);
- **``tandem bench perplexity``** with ``--window N --stride N --max-tokens K x N``: the
  same K chunks of its own tokens of the text, each scored from its second token on
  (N - 1 tokens a chunk, the early ones with little context, so a higher figure).

Whether the two tokenizers agree on the text is recorded too. One JSON file (``--output-
json``), rendered by ``docs/hooks/bench_figures.py``.

    python tools/perplexity_vs_llamacpp.py \\
        --output-json benchmarks/results/cpu/perplexity-llamacpp-smollm2-q4_1.json
    python tools/perplexity_vs_llamacpp.py --context 1024 --chunks 4 --llama-bin-dir DIR
    python tools/perplexity_vs_llamacpp.py --model smollm2-q8_0
    python tools/perplexity_vs_llamacpp.py --cpu-int8-activations --output-json \
        benchmarks/results/cpu/perplexity-llamacpp-smollm2-q4_1-int8-activations.json

``--model`` picks the GGUF file as ``tools/bench_vllm_cpu.py`` does: tandem's default
model (Q4_1), or that file requantized to Q8_0 by ``llama-quantize``.

llama.cpp comes from ``tools/llamacpp_build.py`` (or ``--llama-bin-dir``). Logs go to
``build/bench-vllm-cpu/``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_cpu as bench  # the sibling scripts
import llamacpp_build

ROOT = bench.ROOT
BENCHMARK_ID = "perplexity_vs_llamacpp"
SCHEMA_VERSION = 1
DEFAULT_TEXT = bench.TEXT.relative_to(ROOT)  # the comparison's text, public domain
FINAL = re.compile(r"Final estimate: PPL = (?P<ppl>[0-9.]+) \+/- (?P<error>[0-9.]+)")
CHUNKS = re.compile(r"calculating perplexity over (?P<chunks>\d+) chunks, n_ctx=(?P<ctx>\d+)")


def log(message: str) -> None:
    print(f"[perplexity_vs_llamacpp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """A perplexity over ``tokens`` scored tokens, with llama-perplexity's error bar
    (the standard error of the mean NLL, times the perplexity)."""

    perplexity: float
    error: float
    tokens: int

    def record(self) -> dict[str, Any]:
        return {"perplexity": self.perplexity, "error": self.error, "scored_tokens": self.tokens}


def estimate(logprobs: Sequence[float]) -> Estimate:
    """llama-perplexity's figures from the scored tokens' logprobs."""
    n = len(logprobs)
    if n < 2:
        raise ValueError(f"need at least 2 scored tokens, got {n}")
    nll = -math.fsum(logprobs) / n
    nll2 = math.fsum(lp * lp for lp in logprobs) / n - nll * nll
    ppl = math.exp(nll)
    return Estimate(ppl, math.sqrt(max(nll2, 0.0) / (n - 1)) * ppl, n)


def chunks(tokens: Sequence[int], context: int, count: int) -> list[list[int]]:
    """llama-perplexity's chunks: the first ``count`` runs of ``context`` tokens."""
    if len(tokens) < 2 * context:
        raise ValueError(
            f"the text is {len(tokens)} tokens: llama-perplexity needs at least 2 x "
            f"{context} (--context)"
        )
    if count * context > len(tokens):
        raise ValueError(
            f"{count} chunks of {context} need {count * context} tokens, the text has {len(tokens)}"
        )
    return [list(tokens[i * context : (i + 1) * context]) for i in range(count)]


def first_scored(context: int) -> int:
    """The chunk position of the first token llama-perplexity scores."""
    return context // 2 + 1


def parse_llama_perplexity(output: str) -> tuple[Estimate, int, int]:
    """llama-perplexity's final estimate, its chunk count and context, from its log."""
    final, counted = FINAL.search(output), CHUNKS.search(output)
    if final is None or counted is None:
        tail = "\n".join(output.rstrip().splitlines()[-20:])
        raise bench.Failure(f"llama-perplexity printed no final estimate:\n{tail}")
    count, context = int(counted["chunks"]), int(counted["ctx"])
    scored = count * (context - first_scored(context))
    return Estimate(float(final["ppl"]), float(final["error"]), scored), count, context


def llama_perplexity_command(
    binary: Path, gguf: Path, text: Path, context: int, count: int
) -> list[str]:
    return [
        str(binary), "--model", str(gguf), "--file", str(text),
        "--ctx-size", str(context), "--chunks", str(count),
        "--threads", str(len(os.sched_getaffinity(0))),
    ]  # fmt: skip


def llama_tokens(args: argparse.Namespace, binary: Path, gguf: Path, text: str) -> list[int]:
    """llama.cpp's tokens of ``text`` as llama-perplexity reads it (special tokens added
    as the vocabulary says, none parsed from the text), from llama-server's /tokenize."""
    port = bench._free_port()
    url = f"http://{bench.HOST}:{port}"
    command = [str(binary), "--model", str(gguf), "--host", bench.HOST, "--port", str(port),
               "--ctx-size", "512", "--parallel", "1", "--threads", "1"]  # fmt: skip
    server = bench.Server("llamacpp-tokenize", command, {}, args.work_dir / "ppl-tokenize.log")
    try:
        server.start(url, 300)
        body = {"content": text, "add_special": True, "parse_special": False}
        response = httpx.post(f"{url}/tokenize", json=body, timeout=300, trust_env=False)
        response.raise_for_status()
        return [int(t) for t in response.json()["tokens"]]
    finally:
        server.stop()


def tandem_same_tokens(
    gguf: Path,
    dtype: str,
    pieces: list[list[int]],
    context: int,
    text: str,
    int8_activations: bool = False,
) -> tuple[Estimate, list[int]]:
    """tandem's estimate on ``pieces``, llama-perplexity's positions scored, and the
    engine's own tokens of ``text`` as ``tandem bench perplexity`` reads it (for the
    comparison of the tokenizers)."""
    from tandem.scheduler import Engine
    from tandem.server.bench.perplexity import engine_scorer

    engine = Engine(str(gguf), dtype=dtype, device="cpu", cpu_int8_activations=int8_activations)
    try:
        if engine.tokenizer is None:
            raise bench.Failure(f"tandem finds no tokenizer in {gguf}")
        own = list(engine.tokenizer.encode(text))
        start = first_scored(context)
        scored = engine_scorer(engine)(pieces, [start] * len(pieces))
        logprobs = [lp for window in scored for lp in window]
        if len(logprobs) != len(pieces) * (context - start):
            raise bench.Failure(f"tandem scored {len(logprobs)} tokens, expected "
                                f"{len(pieces) * (context - start)}")  # fmt: skip
        return estimate(logprobs), own
    finally:
        engine.shutdown()


def tandem_bench_perplexity(
    args: argparse.Namespace, gguf: Path, text: Path
) -> tuple[list[str], dict[str, Any]]:
    """``tandem bench perplexity`` over the same chunks: its command and figures."""
    n = args.context
    command = [
        sys.executable, "-m", "tandem.server.cli", "bench", "perplexity",
        "--model-path", str(gguf), "--text-file", str(text), "--device", "cpu",
        "--dtype", args.dtype, "--window", str(n), "--stride", str(n),
        "--max-tokens", str(n * args.chunks), "--json",
    ]  # fmt: skip
    if args.cpu_int8_activations:
        command.append("--cpu-int8-activations")
    log("$ " + " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise bench.Failure(f"tandem bench perplexity exited with status {done.returncode}:\n"
                            f"{bench._tail(done.stdout + done.stderr)}")  # fmt: skip
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return command, {
        "perplexity": figures["perplexity"],
        "mean_nll": figures["mean_nll"],
        "scored_tokens": figures["tokens"],
        "windows": figures["windows"],
        "window": figures["window"],
        "stride": figures["stride"],
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the two token lists differ (or one ends), else None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        choices=tuple(bench.GGUF_MODELS),
        default=bench.GGUF_MODEL,
        help="the GGUF file, as in tools/bench_vllm_cpu.py (default: %(default)s)",
    )
    parser.add_argument(
        "--text-file", type=Path, default=DEFAULT_TEXT, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--context", type=int, default=512, help="N, tokens per chunk (default: 512)"
    )
    parser.add_argument("--chunks", type=int, default=8, help="K, chunks scored (default: 8)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="tandem's activations, and its weights where dequantized (default: %(default)s)",
    )
    parser.add_argument(
        "--cpu-int8-activations",
        action="store_true",
        help="tandem's quantized products round x to one 8-bit part, as llama.cpp does",
    )
    parser.add_argument("--output-json", type=Path, help="write the record here")
    parser.add_argument(
        "--cache-dir", type=Path, help="where the model is fetched (default: tandem's cache)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=bench.WORK_DIR, help="logs (default: build/bench-vllm-cpu)"
    )
    llamacpp_build.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.context < 4 or args.context % 2:
        parser.error("argument --context: must be an even number of at least 4")
    if args.chunks < 1:
        parser.error("argument --chunks: must be at least 1")
    text_path = args.text_file if args.text_file.is_absolute() else ROOT / args.text_file
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"argument --text-file: cannot read {text_path}: {exc}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        llama = llamacpp_build.resolve_build(args.llama_bin_dir, args.llama_dir)
        checkpoint = bench.checkpoint_for(
            args.model, args.cache_dir, llama=llama, llama_dir=args.llama_dir
        )
        command = bench._recorded_command(argv, __file__)
        record = measure(args, command, llama, checkpoint, text_path, text)
    except (bench.Failure, llamacpp_build.BuildError, ValueError, OSError) as exc:
        log(f"FAILED: {exc}")
        return 1
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(record, indent=2) + "\n")
        log(f"wrote {args.output_json}")
    results, ratio = record["results"], record["tandem_vs_llamacpp_perplexity"]
    print(
        f"llama.cpp {results['llamacpp']['perplexity']:.4f}, tandem on the same tokens "
        f"{results['tandem']['perplexity']:.4f} (ratio {ratio:.5f}), tandem bench "
        f"perplexity {results['tandem_bench_perplexity']['perplexity']:.4f}; "
        f"{args.chunks} chunks of {args.context} tokens"
    )
    return 0


def measure(
    args: argparse.Namespace,
    command: str,
    llama: llamacpp_build.LlamaCpp,
    checkpoint: bench.Checkpoint,
    text_path: Path,
    text: str,
) -> dict[str, Any]:
    """Run both engines (see the module docstring); the results file."""
    gguf, n, k = checkpoint.path, args.context, args.chunks
    ppl_command = llama_perplexity_command(llama.binary("llama-perplexity"), gguf, text_path, n, k)
    log("$ " + " ".join(ppl_command))
    done = subprocess.run(ppl_command, capture_output=True, text=True, check=False)
    (args.work_dir / "ppl-llama-perplexity.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise bench.Failure(f"llama-perplexity exited with status {done.returncode}:\n"
                            f"{bench._tail(done.stdout + done.stderr)}")  # fmt: skip
    llama_estimate, llama_chunks, llama_context = parse_llama_perplexity(done.stdout + done.stderr)
    if (llama_chunks, llama_context) != (k, n):
        raise bench.Failure(f"llama-perplexity scored {llama_chunks} chunks of {llama_context}, "
                            f"not {k} of {n}")  # fmt: skip

    tokens = llama_tokens(args, llama.binary("llama-server"), gguf, text)
    pieces = chunks(tokens, n, k)
    same, own = tandem_same_tokens(gguf, args.dtype, pieces, n, text, args.cpu_int8_activations)
    if same.tokens != llama_estimate.tokens:
        raise bench.Failure(
            f"tandem scored {same.tokens} tokens, llama.cpp {llama_estimate.tokens}"
        )
    differ = first_difference(own[: n * k], tokens[: n * k])
    cli_command, cli = tandem_bench_perplexity(args, gguf, text_path)

    llama_shown = shown_command(ppl_command, gguf, text_path, llama.bin_dir)
    return {
        "benchmark": BENCHMARK_ID,
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": checkpoint.info,
        "dtype": args.dtype,
        "text": {
            "file": _shown(text_path),
            "sha256": _sha256_text(text),
            "llamacpp_tokens": len(tokens),
            "tandem_tokens": len(own),
            "same_tokens_in_chunks": differ is None,
            "first_different_token": differ,
        },
        "context": n,
        "chunks": k,
        "machine": bench.machine(),
        "versions": {**bench.tandem_versions(), "llamacpp": llama.source},
        "engines": {
            "llamacpp": {"command": llama_shown, "build": llama.record()},
            "tandem": {
                "command": shown_command(cli_command, gguf, text_path, None),
                "options": {"cpu_int8_activations": args.cpu_int8_activations},
            },
        },
        "results": {
            "llamacpp": llama_estimate.record(),
            "tandem": same.record(),
            "tandem_bench_perplexity": cli,
        },
        "tandem_vs_llamacpp_perplexity": same.perplexity / llama_estimate.perplexity,
    }


def shown_command(
    command: Sequence[str], gguf: Path, text: Path, llama_bin: Path | None
) -> list[str]:
    """``command`` as recorded: placeholders for the paths of this machine."""
    out = bench.portable(command, gguf, bench.DEFAULT_VENV, llama_bin)
    return [f"<text {text.name}>" if a == str(text) else a for a in out]


def _shown(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


if __name__ == "__main__":
    sys.exit(main())
