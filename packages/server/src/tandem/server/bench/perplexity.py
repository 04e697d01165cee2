"""``tandem bench perplexity``: a model's perplexity over a text file, by sliding window.

Hugging Face's "Perplexity of fixed-length models" method: each window scores the tokens
the previous one did not, with the rest of the window as context. ``windows`` and
``sliding_window_nll`` are the pure part (any scorer); docs/guides/benchmarking.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.server.bench.offline import add_weights_arguments, weights_options

DEFAULT_WINDOW = 1024
"""Tokens per window when ``--window`` is not given (or the model's context, if less)."""


@dataclass(frozen=True)
class Window:
    """One forward: the text's tokens ``[begin, end)``, of which those from
    ``first_scored`` on are scored (the ones before are context only)."""

    begin: int
    end: int
    first_scored: int

    @property
    def scored(self) -> int:
        return self.end - self.first_scored


@dataclass(frozen=True)
class Perplexity:
    """The result: ``nll`` summed over ``tokens`` scored tokens in ``windows`` windows."""

    nll: float
    tokens: int
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows over a text of ``num_tokens`` tokens: starting every ``stride`` tokens,
    each ``window`` long (the last may be shorter), until one reaches the end; each
    scores the tokens after the previous window's end, and never the text's first token
    (nothing predicts it) nor, when ``stride == window``, a window's first (nothing in
    the window precedes it)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text must have at least 2 tokens to score, got {num_tokens}")
    out: list[Window] = []
    previous_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == num_tokens:
            break
    return out


Scorer = Callable[[Sequence[Sequence[int]], Sequence[int]], Sequence[Sequence[float]]]
"""Scores windows at once: given each window's tokens and the index (in the window) of
its first scored token, returns per window the logprob of each token from there on,
given the window's tokens before it."""


def sliding_window_nll(ids: Sequence[int], window: int, stride: int, score: Scorer) -> Perplexity:
    """The perplexity of the token sequence ``ids`` by sliding window (``windows``), each
    window's logprobs from ``score``."""
    spans = [w for w in windows(len(ids), window, stride) if w.scored > 0]
    chunks = [list(ids[w.begin : w.end]) for w in spans]
    starts = [w.first_scored - w.begin for w in spans]
    logprobs = score(chunks, starts)
    if len(logprobs) != len(spans):
        raise ValueError(f"the scorer returned {len(logprobs)} windows for {len(spans)}")
    nll, tokens = 0.0, 0
    for w, lps in zip(spans, logprobs, strict=True):
        if len(lps) != w.scored:
            raise ValueError(f"the scorer returned {len(lps)} logprobs for {w.scored} tokens")
        nll -= math.fsum(lps)
        tokens += w.scored
    return Perplexity(nll, tokens, len(spans))


def engine_scorer(engine: Any) -> Scorer:
    """Score windows with ``engine``'s prompt logprobs: one batch call, no token
    generated (``max_new_tokens`` 0)."""

    def score(chunks: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        outs = engine.generate(
            input_ids=[list(c) for c in chunks],
            sampling_params={"max_new_tokens": 0, "temperature": 0},
            return_logprob=True,
            logprob_start_len=list(starts),
        )
        return [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]] for out in outs]

    return score


# -- the command --------------------------------------------------------------------------------
def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="tandem bench perplexity",
            description="A model's perplexity over a text file, by sliding window.",
        )
    parser.add_argument("--text-file", required=True, help="the text to score (UTF-8)")
    parser.add_argument(
        "--model-path", help="the model, in any form `tandem serve` takes (default: its default)"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="model dtype (default: auto)")
    add_weights_arguments(parser)
    parser.add_argument(
        "--window",
        type=int,
        help=f"tokens per forward (default: the model's context or {DEFAULT_WINDOW}, "
        "whichever is smaller)",
    )
    parser.add_argument(
        "--stride", type=int, help="tokens between window starts (default: window / 2)"
    )
    parser.add_argument(
        "--max-tokens", type=int, help="score only the text's first this many tokens"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tandem.scheduler import Engine

    path = Path(args.text_file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"argument --text-file: cannot read {path}: {exc}")
    if args.max_tokens is not None and args.max_tokens < 2:
        parser.error("argument --max-tokens: must be at least 2")
    try:
        engine = Engine(
            args.model_path, dtype=args.dtype, device=args.device, **weights_options(args)
        )
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        if engine.tokenizer is None:
            parser.error("argument --model-path: the model has no tokenizer to read the text")
        ids = engine.tokenizer.encode(text)
        if args.max_tokens is not None:
            ids = ids[: args.max_tokens]
        window = args.window or min(engine.context_length, DEFAULT_WINDOW)
        if not 2 <= window <= engine.context_length:
            parser.error(f"argument --window: must be in [2, {engine.context_length}]")
        stride = args.stride or max(1, window // 2)
        try:
            result = sliding_window_nll(ids, window, stride, engine_scorer(engine))
        except ValueError as exc:
            parser.error(str(exc))
        figures = {
            "perplexity": result.perplexity,
            "mean_nll": result.mean_nll,
            "tokens": result.tokens,
            "windows": result.windows,
            "window": window,
            "stride": stride,
            "text_tokens": len(ids),
            "model_path": str(engine.model_path),
        }
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.4f}) over "
            f"{result.tokens} tokens in {result.windows} windows of {window} (stride {stride})"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    return run(parser.parse_args(argv), parser)
