"""The tokenizer inside a GGUF file, written out as a Hugging Face tokenizer folder.

``write_gguf_tokenizer(reader, folder)`` rebuilds the tokenizer llama.cpp runs from the
file's ``tokenizer.ggml.*`` metadata (``gpt2`` byte-level BPE split per
``tokenizer.ggml.pre``, or ``llama`` SentencePiece with byte fallback) as
``tokenizer.json`` and ``tokenizer_config.json``; any other kind is a ``ValueError``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

SUPPORTED_KINDS: tuple[str, ...] = ("gpt2", "llama")

# llama.cpp's token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The split patterns of llama-vocab.cpp, per pre-tokenizer. A tuple is applied in order,
# each pattern cutting the pieces the one before left (matches and the text between them
# both become pieces), as llama.cpp's unicode_regex_split does.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp splits text for one ``tokenizer.ggml.pre``: the patterns, whether
    a piece that is a whole vocabulary token skips the merges, and whether BOS is added
    when the file does not say (``tokenizer.ggml.add_bos_token``)."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2_PRE = _PreTokenizer((_GPT2,))
# llama.cpp's own default, for files that name no pre-tokenizer at all.
_DEFAULT_PRE = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_DIGITS_THEN_GPT2 = _PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _PreTokenizer((_QWEN2,))
# Stops at ASCII and ideographic, Devanagari and Arabic punctuation (escaped for ruff).
_BLOOM_PRE = _PreTokenizer((" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",))


def _named(pre: _PreTokenizer, *names: str) -> dict[str, _PreTokenizer]:
    return dict.fromkeys(names, pre)


_PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = {
    "default": _DEFAULT_PRE,
    **_named(_GPT2_PRE, "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "gigachat"),
    **_named(
        _DIGITS_THEN_GPT2,
        "smollm",
        "starcoder",
        "refact",
        "command-r",
        "codeshell",
        "exaone",
        "minerva-7b",
    ),
    **_named(
        _LLAMA3_PRE,
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
    ),
    # Llama 3's split, without its BOS and whole-token defaults.
    **_named(_PreTokenizer((_LLAMA3,)), "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"),
    **_named(
        _QWEN2_PRE,
        "qwen2",
        "deepseek-r1-qwen",
        "megrez",
        "stablelm2",
        "hunyuan",
        "grok-2",
        "kormo",
    ),
    "qwen35": _PreTokenizer((_QWEN35,)),
    "tekken": _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_named(_PreTokenizer((_GPT4O,)), "gpt-4o", "llama4", "minimax-m2"),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **_named(_BLOOM_PRE, "bloom", "poro-chat", "gpt3-finnish"),
}

# Token texts llama.cpp treats as end of generation whatever the file's ids say
# (llama-vocab.cpp's list, for the chat formats tandem serves).
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<end_of_utterance>",
    }
)


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What a model config needs from the tokenizer of a GGUF.

    Attributes:
        kind: ``tokenizer.ggml.model`` (``"gpt2"`` or ``"llama"``).
        vocab_size: tokens in the file; the embedding may be larger.
        bos_token_id, eos_token_id, pad_token_id: as the file gives them (for ``llama``
            files without them, llama.cpp's defaults 1 and 2); ``None`` when absent.
        bos_token, eos_token: the texts of those ids.
        stop_token_ids: every id llama.cpp ends generation on: eos, the file's eot/eom
            ids, and the tokens it recognizes by text (``<|im_end|>``, ``<|eot_id|>``...).
    """

    kind: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    stop_token_ids: tuple[int, ...]


def write_gguf_tokenizer(reader: gguf.GGUFReader, folder: Path) -> GGUFTokenizerInfo:
    """Write the GGUF's tokenizer into ``folder`` as tokenizer.json and
    tokenizer_config.json, and return what the model config needs from it."""
    meta = _Metadata(reader)
    kind = meta.string("tokenizer.ggml.model")
    if kind is None or kind in ("none", "no_vocab") or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(
            f"{meta.source} has no tokenizer (no tokenizer.ggml.model and tokenizer.ggml.tokens "
            "metadata); pass --tokenizer FOLDER with a Hugging Face tokenizer folder "
            "(tokenizer.json, tokenizer_config.json) for this model"
        )
    if kind not in SUPPORTED_KINDS:
        raise ValueError(
            f"{meta.source} has a tokenizer of kind {kind!r} (tokenizer.ggml.model), which "
            f"tandem cannot rebuild; supported kinds: {', '.join(SUPPORTED_KINDS)}. Pass "
            "--tokenizer FOLDER with the model's Hugging Face tokenizer folder instead"
        )
    tokens = _tokens(meta)
    types = meta.int_array("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) < len(tokens):
        raise ValueError(
            f"{meta.source}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    if kind == "gpt2":
        pre = _pre_tokenizer(meta.string("tokenizer.ggml.pre"))
        backend = _byte_level_backend(meta, tokens, pre)
        add_bos_default = pre.add_bos
    else:
        backend = _sentencepiece_backend(meta, tokens, types)
        add_bos_default = True
    _add_typed_tokens(backend, tokens, types)

    ids = _special_ids(meta, kind, len(tokens))
    add_bos = meta.boolean("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = meta.boolean("tokenizer.ggml.add_eos_token", False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids.get(name) is None:
            raise ValueError(
                f"{meta.source}: tokenizer.ggml.add_{name}_token is true but "
                f"tokenizer.ggml.{name}_token_id is not set"
            )
    backend.post_processor = _post_processor(
        tokens, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None
    )

    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = _tokenizer_config(meta, tokens, ids, add_bos=add_bos, add_eos=add_eos)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return _info(kind, tokens, ids)


class _Metadata:
    """Typed reads of a GGUFReader's key/value fields.

    Goes through ``fields[key].parts``/``.data`` rather than ``ReaderField.contents()``,
    which older ``gguf`` releases lack.
    """

    def __init__(self, reader: gguf.GGUFReader) -> None:
        import gguf

        self._fields = reader.fields
        self._types = gguf.GGUFValueType
        name = getattr(reader.data, "filename", None)
        self.source = f"the GGUF file {name}" if name else "the GGUF file"

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def names(self) -> list[str]:
        return list(self._fields)

    def string(self, key: str) -> str | None:
        field = self._fields.get(key)
        if field is None:
            return None
        self._expect(field, key, self._types.STRING)
        return _text(field.parts[field.data[0]])

    def integer(self, key: str) -> int | None:
        field = self._fields.get(key)
        if field is None:
            return None
        value = field.parts[field.data[0]].tolist()[0] if field.data else None
        if not isinstance(value, int) or isinstance(value, bool) or len(field.types) != 1:
            raise ValueError(f"{self.source}: {key} is not an integer")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        field = self._fields.get(key)
        if field is None:
            return default
        self._expect(field, key, self._types.BOOL)
        return bool(field.parts[field.data[0]].tolist()[0])

    def string_array(self, key: str) -> list[str] | None:
        field = self._fields.get(key)
        if field is None:
            return None
        self._expect(field, key, self._types.ARRAY, self._types.STRING)
        return [_text(field.parts[index]) for index in field.data]

    def int_array(self, key: str) -> list[int] | None:
        field = self._fields.get(key)
        if field is None:
            return None
        self._expect(field, key, self._types.ARRAY)
        return [int(field.parts[index].tolist()[0]) for index in field.data]

    def float_array(self, key: str) -> list[float] | None:
        field = self._fields.get(key)
        if field is None:
            return None
        self._expect(field, key, self._types.ARRAY)
        return [float(field.parts[index].tolist()[0]) for index in field.data]

    def _expect(self, field: Any, key: str, *types: Any) -> None:
        if tuple(field.types[: len(types)]) != types:
            wanted = " of ".join(t.name.lower() for t in types)
            raise ValueError(f"{self.source}: {key} is not a {wanted}")


def _text(part: Any) -> str:
    return bytes(part).decode("utf-8", errors="replace")


def _tokens(meta: _Metadata) -> list[str]:
    """The token texts; empty ones renamed and duplicates refused, as llama.cpp does."""
    tokens = meta.string_array("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(
            f"{meta.source} has an empty tokenizer.ggml.tokens; pass --tokenizer FOLDER with a "
            "Hugging Face tokenizer folder for this model"
        )
    tokens = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    seen: dict[str, int] = {}
    for index, token in enumerate(tokens):
        first = seen.setdefault(token, index)
        if first != index:
            raise ValueError(
                f"{meta.source}: token {token!r} appears twice in tokenizer.ggml.tokens "
                f"(ids {first} and {index})"
            )
    return tokens


def _pre_tokenizer(name: str | None) -> _PreTokenizer:
    if name is None:
        log.warning(
            "the GGUF names no pre-tokenizer (tokenizer.ggml.pre); splitting text with "
            "llama.cpp's 'default' patterns, as llama.cpp does; tokens may differ from the "
            "model's own tokenizer"
        )
        return _DEFAULT_PRE
    pre = _PRE_TOKENIZERS.get(name)
    if pre is None:
        log.warning(
            "unknown pre-tokenizer %r (tokenizer.ggml.pre) in the GGUF; splitting text as "
            "GPT-2 does, which may differ from the model's own tokenizer",
            name,
        )
        return _GPT2_PRE
    return pre


def _byte_level_backend(
    meta: _Metadata, tokens: Sequence[str], pre: _PreTokenizer
) -> BackendTokenizer:
    """Byte-level BPE: the file's tokens are already in GPT-2's byte alphabet."""
    merges = meta.string_array("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{meta.source}: a gpt2 tokenizer without tokenizer.ggml.merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab, _merge_pairs(merges, vocab), ignore_merges=pre.ignore_merges, fuse_unk=False
    )
    backend = BackendTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.patterns]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _merge_pairs(merges: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``"left right"`` strings as pairs, split at the first space after the first
    character as llama.cpp does; a merge naming a token the file lacks can never apply
    there, so it is dropped here (``tokenizers`` would refuse it)."""
    pairs = []
    dropped = 0
    for merge in merges:
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1 :]) if cut >= 0 else (merge, "")
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
        else:
            dropped += 1
    if dropped:
        log.warning("dropped %d GGUF merges whose tokens are not in the vocabulary", dropped)
    return pairs


def _sentencepiece_backend(
    meta: _Metadata, tokens: Sequence[str], types: Sequence[int]
) -> BackendTokenizer:
    """SentencePiece BPE as a ``tokenizers`` BPE model.

    llama.cpp merges, among adjacent symbols, the pair whose concatenation is the
    highest-scoring piece; a BPE model does the same when its merges are every split
    of every piece into two pieces, ranked by the whole piece's score. Spaces become
    ``▁``, with one more in front of each stretch of text (after the start and after
    every added token) when ``tokenizer.ggml.add_space_prefix`` is true (the default).
    """
    scores = meta.float_array("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) < len(tokens):
        raise ValueError(
            f"{meta.source}: tokenizer.ggml.scores has {len(scores)} entries for "
            f"{len(tokens)} tokens"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = _in_range(meta.integer("tokenizer.ggml.unknown_token_id"), len(tokens), 0)
    model = models.BPE(
        vocab,
        _sentencepiece_merges(tokens, types, scores, vocab),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=any(t == _BYTE for t in types[: len(tokens)]),
        fuse_unk=True,
    )
    backend = BackendTokenizer(model)
    add_prefix = meta.boolean("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    return backend


def _sentencepiece_merges(
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float],
    vocab: Mapping[str, int],
) -> list[tuple[str, str]]:
    """Every split of every normal piece into two known tokens, best piece first (ties:
    lower id), the splits of one piece in the order of their halves' ids."""
    ranked = []
    for index, token in enumerate(tokens):
        if types[index] != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[index], index, left_id, right_id, left, right))
    ranked.sort(key=lambda entry: entry[:4])
    return [(left, right) for *_, left, right in ranked]


def _add_typed_tokens(
    backend: BackendTokenizer, tokens: Sequence[str], types: Sequence[int]
) -> None:
    """CONTROL and UNKNOWN tokens become special added tokens, USER_DEFINED ones plain
    added tokens: llama.cpp matches them whole in the text before any splitting."""
    special = [
        AddedToken(tokens[index], special=True, normalized=False)
        for index in range(len(tokens))
        if types[index] in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(tokens[index], special=False, normalized=False)
        for index in range(len(tokens))
        if types[index] == _USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _in_range(token_id: int | None, vocab_size: int, default: int | None) -> int | None:
    """A special id from the file; llama.cpp ignores an out-of-range one (with its
    default in its place) and so do we."""
    if token_id is not None and 0 <= token_id < vocab_size:
        return token_id
    if token_id is not None:
        log.warning("GGUF special token id %d is outside the vocabulary; ignored", token_id)
    return default if default is not None and default < vocab_size else None


def _special_ids(meta: _Metadata, kind: str, vocab_size: int) -> dict[str, int | None]:
    """bos/eos/unk/pad/eot/eom ids. SentencePiece files default to llama.cpp's 1, 2 and
    0; byte-level ones to nothing (llama.cpp's default there, 11, is GPT-2's era)."""
    spm = kind == "llama"
    defaults = {"bos": 1 if spm else None, "eos": 2 if spm else None, "unknown": 0 if spm else None}
    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        key = f"tokenizer.ggml.{name}_token_id"
        ids[name] = _in_range(meta.integer(key), vocab_size, defaults.get(name))
    return ids


def _post_processor(
    tokens: Sequence[str], bos: int | None, eos: int | None
) -> processors.TemplateProcessing | None:
    """``[bos] $A [eos]`` for what the file asks to add; nothing when it adds nothing."""
    if bos is None and eos is None:
        return None

    def sequence(name: str, type_id: int) -> list[str]:
        pieces = [] if bos is None else [f"{tokens[bos]}:{type_id}"]
        pieces.append(f"${name}:{type_id}")
        return pieces if eos is None else [*pieces, f"{tokens[eos]}:{type_id}"]

    specials = {tokens[i]: i for i in (bos, eos) if i is not None}
    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=list(specials.items()),
    )


def _tokenizer_config(
    meta: _Metadata,
    tokens: Sequence[str],
    ids: Mapping[str, int | None],
    *,
    add_bos: bool,
    add_eos: bool,
) -> dict[str, Any]:
    def text(name: str) -> str | None:
        token_id = ids.get(name)
        return None if token_id is None else tokens[token_id]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "unk_token": text("unknown"),
        "pad_token": text("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    templates = _chat_templates(meta)
    if set(templates) == {"default"}:
        config["chat_template"] = templates["default"]
    elif templates:
        config["chat_template"] = [
            {"name": name, "template": template} for name, template in templates.items()
        ]
    return config


def _chat_templates(meta: _Metadata) -> dict[str, str]:
    """``tokenizer.chat_template`` verbatim, plus named ones (``tokenizer.chat_template.
    tool_use``...) where the converter wrote a list of templates."""
    templates = {}
    default = meta.string("tokenizer.chat_template")
    if default is not None:
        templates["default"] = default
    prefix = "tokenizer.chat_template."
    for key in meta.names():
        if key.startswith(prefix):
            template = meta.string(key)
            if template is not None:
                templates[key[len(prefix) :]] = template
    return templates


def _info(kind: str, tokens: Sequence[str], ids: Mapping[str, int | None]) -> GGUFTokenizerInfo:
    stops = {ids[name] for name in ("eos", "eot", "eom") if ids[name] is not None}
    stops |= {index for index, token in enumerate(tokens) if token in _END_OF_GENERATION_TEXTS}
    bos, eos = ids["bos"], ids["eos"]
    return GGUFTokenizerInfo(
        kind=kind,
        vocab_size=len(tokens),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=ids["padding"],
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
        stop_token_ids=tuple(sorted(stops)),
    )
