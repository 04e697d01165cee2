"""``python -m tandem.scheduler``: one-off offline generation with the ``Engine``.

With no ``--model-path`` it uses the default model (SmolLM2-135M-Instruct, fetched once
into the user's cache); ``--model-path tandem-tiny`` takes the tiny test model, which
needs no download. ``tandem generate`` runs it too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tandem.scheduler.engine.engine import Engine
from tandem.scheduler.models.fetch import FetchError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.scheduler",
        description="Generate text offline with tandem's Engine.",
    )
    parser.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument(
        "--model-path",
        help="model folder, GGUF file, Hugging Face id, or tandem-tiny (default: the "
        "default model, SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--no-stream", action="store_true", help="print when finished")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = args.prompt or ["Once upon a time"]
    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    try:
        engine = Engine(
            model_path=args.model_path,
            device=args.device,
            dtype=args.dtype,
        )
    except (ValueError, FileNotFoundError, FetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with engine:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            print("error: this model has no tokenizer.json to encode prompts", file=sys.stderr)
            return 2
        try:
            for prompt in prompts:
                print(f"--- {prompt!r}")
                if args.chat:
                    # The template's special tokens (BOS included); the prompt is text.
                    messages = [{"role": "user", "content": prompt}]
                    ids = tokenizer.encode_pieces(tokenizer.chat_pieces(messages))
                else:
                    ids = tokenizer.encode(prompt) if prompt else []
                if args.no_stream:
                    print(engine.generate(input_ids=ids, sampling_params=params)["text"])
                    continue
                for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
                    print(chunk["text"], end="", flush=True)
                print()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0
