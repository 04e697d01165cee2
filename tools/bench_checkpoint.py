#!/usr/bin/env python3
"""Llama-shaped checkpoints for benchmarking tandem against other serving engines.

Each size is an ordinary Hugging Face folder (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``) that tandem,
transformers and vLLM all load: ``LlamaForCausalLM`` with random normal weights (std
0.02, norm weights 1) from a fixed seed, stored in float32 (the output head never picks
a token without text of its own, see ``write_checkpoint``), and a byte-level BPE
tokenizer trained on ``tools/data/tinyshakespeare.txt`` to a vocabulary of 9000 (the
special tokens included). Every build writes the same bytes.

The sizes (``--list`` prints them with their parameter counts):

- ``10m``: hidden 256, 6 layers, 4 heads, 2 KV heads, intermediate 768 (9.3M parameters);
- ``100m``: hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048 (89M).

    python tools/bench_checkpoint.py 100m              # built once into the cache, path printed
    python tools/bench_checkpoint.py 10m --output DIR  # written into DIR (absent or empty)

The cache is tandem's own (``$TANDEM_CACHE_DIR/tandem``, else ``~/.cache/tandem``), or
``--cache-dir``; a folder is used only when its completion marker, written last, is there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tandem.scheduler.models.tiny import (
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    SPECIAL_TOKENS,
    bpe_tokenizer,
    build_once,
    cache_root,
    llama_config,
    llama_weights,
    special_id,
    tokenizer_config,
    train_merges,
    write_json,
)

# Bump whenever any byte of any size changes: a cached folder of the old build must not
# be taken for the new one.
VERSION = "v1"
TEXT = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
VOCAB_SIZE = 9000
CONTEXT = 2048
SEED = 20261124
MARKER = ".bench-checkpoint-complete"

SIZES: dict[str, dict[str, int]] = {
    "10m": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
    },
    "100m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
    },
}


def checkpoint_name(size: str) -> str:
    return f"bench-llama-{size}-{VERSION}"


def build_tokenizer(text: str) -> Tokenizer:
    """The tiny test model's kind of byte-level BPE, trained on ``text`` to ``VOCAB_SIZE``
    entries with the special tokens."""
    # min_frequency 1, not 2: merges seen twice stop short of 5000 entries on this text
    return bpe_tokenizer(train_merges(text, VOCAB_SIZE - len(SPECIAL_TOKENS), 1))


def checkpoint_config(size: str, tokenizer: Tokenizer) -> dict[str, Any]:
    return llama_config(tokenizer, SIZES[size], CONTEXT)


def checkpoint_weights(
    config: dict[str, Any], unprintable: Sequence[int] = ()
) -> dict[str, torch.Tensor]:
    """``llama_weights`` from this tool's seed, with the output head's rows of
    ``unprintable`` zero: their logit is always 0, below the largest of thousands of
    random ones, so greedy decoding never picks them."""
    weights = llama_weights(config, SEED)
    weights["lm_head.weight"][list(unprintable)] = 0.0
    return weights


def parameter_count(size: str) -> int:
    shape = SIZES[size]
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden
    return 2 * VOCAB_SIZE * hidden + shape["num_hidden_layers"] * layer + hidden


def write_checkpoint(size: str, folder: Path) -> None:
    """Every file of ``size`` into the existing, empty ``folder``; the marker last."""
    tokenizer = build_tokenizer(TEXT.read_text(encoding="utf-8"))
    config = checkpoint_config(size, tokenizer)
    if config["vocab_size"] != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer came out with {config['vocab_size']} entries")
    (folder / "tokenizer.json").write_bytes((tokenizer.to_str(pretty=True) + "\n").encode())
    write_json(folder / "tokenizer_config.json", tokenizer_config(END_OF_TEXT_TOKEN, CONTEXT))
    write_json(folder / "config.json", config)
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": [config["eos_token_id"], special_id(tokenizer, IM_END_TOKEN)],
        },
    )
    # Tokens that stream no text of their own (special tokens, which servers skip, and
    # the bytes 128-255, pieces of UTF-8 characters; the training text is ASCII, so no
    # merge holds one): a client times tokens by the text chunks it receives, so every
    # generated token must bring some.
    unprintable = [*range(128, 256), *(special_id(tokenizer, t) for t in SPECIAL_TOKENS)]
    weights = checkpoint_weights(config, unprintable)
    save_file(weights, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / MARKER).write_text(checkpoint_name(size) + "\n", encoding="utf-8")


def is_complete(folder: Path, size: str) -> bool:
    try:
        return (folder / MARKER).read_text(encoding="utf-8") == checkpoint_name(size) + "\n"
    except OSError:
        return False


def checkpoint_path(size: str, cache_dir: Path | None = None) -> Path:
    """The cached folder of ``size``, built on first use (``build_once``)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: one of {', '.join(SIZES)}")
    target = cache_root(cache_dir) / checkpoint_name(size)
    return build_once(
        target, lambda folder: write_checkpoint(size, folder), lambda f: is_complete(f, size)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("size", nargs="?", choices=tuple(SIZES), help="which checkpoint")
    parser.add_argument("--output", type=Path, help="write into this folder (absent or empty)")
    parser.add_argument("--cache-dir", type=Path, help="cache base (default: tandem's cache)")
    parser.add_argument("--list", action="store_true", help="print the sizes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, shape in SIZES.items():
            print(f"{name}: {parameter_count(name):,} parameters, {shape}")
        return 0
    if args.size is None:
        parser.error("the size is required (or --list)")
    if args.output is None:
        print(checkpoint_path(args.size, args.cache_dir))
        return 0
    if args.output.exists() and any(args.output.iterdir()):
        parser.error(f"argument --output: {args.output} is not empty")
    args.output.mkdir(parents=True, exist_ok=True)
    write_checkpoint(args.size, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
