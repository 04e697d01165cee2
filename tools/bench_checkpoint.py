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
import json
import os
import shutil
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from tandem.scheduler.default_model import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    SPECIAL_TOKENS,
    _byte_alphabet,
    _write_json,
    cache_root,
)

# Bump whenever any byte of any size changes: a cached folder of the old build must not
# be taken for the new one.
VERSION = "v1"
TEXT = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
VOCAB_SIZE = 9000
CONTEXT = 2048
SEED = 20261124
INIT_STD = 0.02
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
    """Byte-level BPE: ids 0-255 are the bytes, then the merges in order, then the special
    tokens. Encoding adds the BOS token, as Llama 3's does."""
    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        # 1, not 2: merges seen twice stop short of 5000 entries on this text
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    scratch.train_from_iterator([text], trainer=trainer)
    merges = [(str(a), str(b)) for a, b in json.loads(scratch.to_str())["model"]["merges"]]

    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, _token_id(tokenizer, BOS_TOKEN))],
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"the tokenizer lacks its special token {token}")
    return int(token_id)


def checkpoint_config(size: str, tokenizer: Tokenizer) -> dict[str, Any]:
    shape = SIZES[size]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": _token_id(tokenizer, BOS_TOKEN),
        "eos_token_id": _token_id(tokenizer, END_OF_TEXT_TOKEN),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def checkpoint_weights(
    config: Mapping[str, Any], unprintable: Sequence[int] = ()
) -> dict[str, torch.Tensor]:
    """Seeded normal weights under Hugging Face's Llama names. Drawn in float64, then
    rounded: float32 sampling takes CPU-dependent vectorised paths, float64 does not.

    The output head's rows of ``unprintable`` are zero: their logit is always 0, below
    the largest of thousands of random ones, so greedy decoding never picks them.
    """
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    hidden = int(config["hidden_size"])
    inner = int(config["intermediate_size"])
    head_dim = int(config["head_dim"])
    q_size = int(config["num_attention_heads"]) * head_dim
    kv_size = int(config["num_key_value_heads"]) * head_dim
    vocab = int(config["vocab_size"])

    def normal(rows: int, cols: int) -> torch.Tensor:
        draw = torch.randn((rows, cols), generator=generator, dtype=torch.float64)
        return (draw * INIT_STD).to(torch.float32).contiguous()

    weights = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        layer = f"model.layers.{i}"
        weights[f"{layer}.self_attn.q_proj.weight"] = normal(q_size, hidden)
        weights[f"{layer}.self_attn.k_proj.weight"] = normal(kv_size, hidden)
        weights[f"{layer}.self_attn.v_proj.weight"] = normal(kv_size, hidden)
        weights[f"{layer}.self_attn.o_proj.weight"] = normal(hidden, q_size)
        weights[f"{layer}.mlp.gate_proj.weight"] = normal(inner, hidden)
        weights[f"{layer}.mlp.up_proj.weight"] = normal(inner, hidden)
        weights[f"{layer}.mlp.down_proj.weight"] = normal(hidden, inner)
        weights[f"{layer}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{layer}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    head = normal(vocab, hidden)
    head[list(unprintable)] = 0.0
    weights["lm_head.weight"] = head
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
    _write_json(
        folder / "tokenizer_config.json",
        {
            # Without it transformers would pick its Llama tokenizer class, which rebuilds
            # a SentencePiece-style pipeline instead of reading tokenizer.json as written.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": END_OF_TEXT_TOKEN,
            "pad_token": END_OF_TEXT_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": CONTEXT,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(folder / "config.json", config)
    _write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": [config["eos_token_id"], _token_id(tokenizer, IM_END_TOKEN)],
        },
    )
    # Tokens that stream no text of their own (special tokens, which servers skip, and
    # the bytes 128-255, pieces of UTF-8 characters; the training text is ASCII, so no
    # merge holds one): a client times tokens by the text chunks it receives, so every
    # generated token must bring some.
    unprintable = [*range(128, 256), *(_token_id(tokenizer, t) for t in SPECIAL_TOKENS)]
    weights = checkpoint_weights(config, unprintable)
    save_file(weights, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / MARKER).write_text(checkpoint_name(size) + "\n", encoding="utf-8")


def is_complete(folder: Path, size: str) -> bool:
    try:
        return (folder / MARKER).read_text(encoding="utf-8") == checkpoint_name(size) + "\n"
    except OSError:
        return False


def checkpoint_path(size: str, cache_dir: Path | None = None) -> Path:
    """The cached folder of ``size``, built on first use (in a hidden sibling folder,
    renamed into place, so a concurrent or interrupted build is never seen half-done)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: one of {', '.join(SIZES)}")
    target = cache_root(cache_dir) / checkpoint_name(size)
    if is_complete(target, size):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.building"
    staging.mkdir()
    try:
        write_checkpoint(size, staging)
        if target.exists() and not is_complete(target, size):
            shutil.rmtree(target)  # debris of a build interrupted by hand
        try:
            os.rename(staging, target)
        except OSError:
            if not is_complete(target, size):  # someone else's complete build is fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


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
