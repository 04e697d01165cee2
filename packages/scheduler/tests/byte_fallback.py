"""A Llama 2 style (SentencePiece) tokenizer pipeline for the tests, built in memory:
``▁`` for spaces, a leading ``▁`` stripped on decode, byte-fallback pieces for
characters outside the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

SPECIAL = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_backend(pieces: Sequence[str]) -> BackendTokenizer:
    """The pipeline over ``<unk>``, ``<s>``, ``</s>`` (ids 0-2), the 256 byte pieces and
    then ``pieces``."""
    vocab = {piece: i for i, piece in enumerate([*SPECIAL, *BYTES, *pieces])}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend
