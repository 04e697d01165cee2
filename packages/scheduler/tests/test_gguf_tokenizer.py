"""A GGUF's tokenizer, rewritten as a Hugging Face folder, tokenizes as the references do:
transformers' own GGUF tokenizer on the real SmolLM2 file (byte-level BPE), the
sentencepiece library on a SentencePiece model trained here and stored the way llama.cpp's
converter stores it, and llama.cpp's documented split patterns where transformers ignores
them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import transformers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

from tandem.scheduler.models.gguf_tokenizer import GGUFTokenizerInfo, write_gguf_tokenizer
from tandem.scheduler.text.tokenizer import Tokenizer

# English, code, unicode, emoji, whitespace runs, newlines, contractions, chat markup.
TEXTS = (
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }  // C++",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🙂🚀 and a family 👨\u200d👩\u200d👧 end",
    "tabs\tand   multiple     spaces   ",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\nline five\r\nwindows",
    "It's, we're, they'll, I'd, you've, don't, IT'S",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "",
    " ",
    "\n\n",
)
NUMBERS = ("numbers: 3.14159, 2024-06-01, 1,000,000 and 42", "x 1234567", "v1.2.3 build 20240601")


def _write_gguf(
    path: Path, vocab_size: int, tokenizer: Callable[[gguf.GGUFWriter], None] | None
) -> Path:
    """A well-formed llama GGUF (one tiny F32 embedding) with whatever tokenizer
    metadata ``tokenizer`` writes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(4)
    writer.add_block_count(1)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer is not None:
        tokenizer(writer)
    writer.add_tensor("token_embd.weight", np.zeros((vocab_size, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(gguf_path: Path, folder: Path) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    info = write_gguf_tokenizer(gguf.GGUFReader(gguf_path), folder)
    return Tokenizer.from_pretrained(folder), info


def _transformers_tokenizer(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _mismatches(ours: Callable[[str], Any], theirs: Callable[[str], Any], texts: Sequence[str]):
    return [(text, ours(text), theirs(text)) for text in texts if ours(text) != theirs(text)]


# -- gpt2 kind: the real SmolLM2 file ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    tokenizer, info = _load(smollm2_gguf, tmp_path_factory.mktemp("smollm2_tokenizer"))
    return tokenizer, info, _transformers_tokenizer(smollm2_gguf)


def test_smollm2_encodes_and_decodes_like_transformers(smollm2) -> None:
    tokenizer, _, hf = smollm2
    for add_special in (True, False):
        assert not _mismatches(
            lambda t: tokenizer.encode(t, add_special_tokens=add_special),  # noqa: B023
            lambda t: hf.encode(t, add_special_tokens=add_special),  # noqa: B023
            (*TEXTS, *NUMBERS),
        )
    for text in (*TEXTS, *NUMBERS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_smollm2_digits_are_split_one_by_one(smollm2) -> None:
    # llama.cpp's 'smollm' pre-tokenizer isolates every digit (\p{N}) before GPT-2's split,
    # as SmolLM2's own tokenizer.json does. transformers' GGUF converter ignores 'pre' and
    # keeps digit runs whole; it agrees above only because SmolLM2's vocabulary has no
    # merges across digits, so the split itself is checked against llama.cpp's rule here
    # (and, on a vocabulary with such merges, in test_pre_tokenizer_splits_as_llama_cpp).
    tokenizer, _, _ = smollm2
    for text in NUMBERS:
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
        assert "".join(pieces) == text
        for piece in pieces:
            assert not any(c.isdigit() for c in piece) or piece.strip().isdigit()
            assert sum(c.isdigit() for c in piece) <= 1, (text, pieces)
    digits = tokenizer.encode("2024")
    assert digits == [tokenizer.token_to_id(d) for d in "2024"]


def test_smollm2_special_tokens_and_chat_template(smollm2) -> None:
    tokenizer, info, hf = smollm2
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert {1, 2} <= tokenizer.all_special_ids
    assert info == GGUFTokenizerInfo(
        kind="gpt2",
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        stop_token_ids=(0, 2),
    )
    assert tokenizer.eos_token_id == 2
    assert 2 in tokenizer.eos_token_ids
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?\n  Answer with   one digit."},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? 🙂"},
    ]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids == hf.encode(prompt, add_special_tokens=False)
    assert (ids.count(1), ids.count(2)) == (5, 4)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert "<|im_start|>" not in tokenizer.decode(ids)


# -- gpt2 kind: the pre-tokenizer follows tokenizer.ggml.pre --------------------------------

BPE_CORPUS = (
    "In 2023 and 2024, about 1234567 people read 123 books and 4567 papers; "
    "it's 12:30 now.\nThey'll say it's fine. We'RE here. The year 1999 was 1999.\n"
    "Numbers like 100, 200, 300 and 1000 appear often: 100 200 300 1000 2000.\n"
    "def f(x):\n    return x * 2  # double it\n\n"
) * 4
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A small byte-level BPE (tokens, merges) trained here on GPT-2's split alone, so it
    has merges across digits that the other pre-tokenizers must keep from applying."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(BPE_CORPUS.splitlines(keepends=True), trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _byte_level_gguf(path: Path, vocab: tuple[list[str], list[str]], pre: str | None) -> Path:
    tokens, merges = vocab

    def tokenizer(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in BPE_SPECIALS else 1 for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))

    return _write_gguf(path, len(tokens), tokenizer)


def _splits(tokenizer: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_pre_tokenizer_matches_transformers(tmp_path: Path, byte_level_vocab, pre: str) -> None:
    # transformers' converter knows these three splits (GPT-2's is its default).
    path = _byte_level_gguf(tmp_path / "bpe.gguf", byte_level_vocab, pre)
    tokenizer, _ = _load(path, tmp_path / "folder")
    hf = _transformers_tokenizer(path)
    texts = (*TEXTS, *NUMBERS, BPE_CORPUS[:300])
    assert not _mismatches(
        lambda t: tokenizer.encode(t, add_special_tokens=False),
        lambda t: hf.encode(t, add_special_tokens=False),
        texts,
    )
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == (
            "<|endoftext|>" + text if pre == "llama-bpe" else text
        )


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        # llama-vocab.cpp's patterns: Llama 3 takes digits in threes and contractions in
        # any case, Qwen2 digits one by one; the starcoder family isolates digits, then
        # GPT-2's split, which keeps a digit run (and its space) whole and knows only
        # lowercase contractions.
        ("llama-bpe", ["x", "Ġ", "123", "456", "7", "Ġit", "'S", "Ġa", ",", "Ġb"]),
        ("llama3", ["x", "Ġ", "123", "456", "7", "Ġit", "'S", "Ġa", ",", "Ġb"]),
        ("qwen2", ["x", "Ġ", *"1234567", "Ġit", "'S", "Ġa", ",", "Ġb"]),
        ("smollm", ["x", "Ġ", *"1234567", "Ġit", "'", "S", "Ġa", ",", "Ġb"]),
        ("starcoder", ["x", "Ġ", *"1234567", "Ġit", "'", "S", "Ġa", ",", "Ġb"]),
        ("gpt-2", ["x", "Ġ1234567", "Ġit", "'", "S", "Ġa", ",", "Ġb"]),
    ],
)
def test_pre_tokenizer_splits_as_llama_cpp(
    tmp_path: Path, byte_level_vocab, pre: str, expected: list[str]
) -> None:
    path = _byte_level_gguf(tmp_path / "bpe.gguf", byte_level_vocab, pre)
    tokenizer, _ = _load(path, tmp_path / "folder")
    assert _splits(tokenizer, "x 1234567 it'S a, b") == expected


def test_llama3_pre_adds_bos_unless_the_file_says_not(tmp_path: Path, byte_level_vocab) -> None:
    # llama.cpp turns add_bos on for the llama3 family when the file is silent.
    path = _byte_level_gguf(tmp_path / "bpe.gguf", byte_level_vocab, "llama-bpe")
    tokenizer, info = _load(path, tmp_path / "folder")
    assert tokenizer.encode("hi")[0] == info.bos_token_id == 0
    gpt2, _ = _load(
        _byte_level_gguf(tmp_path / "g.gguf", byte_level_vocab, "gpt-2"), tmp_path / "g"
    )
    assert gpt2.encode("hi") == gpt2.encode("hi", add_special_tokens=False)


def test_unknown_pre_falls_back_to_gpt2_with_a_warning(
    tmp_path: Path, byte_level_vocab, caplog: pytest.LogCaptureFixture
) -> None:
    path = _byte_level_gguf(tmp_path / "bpe.gguf", byte_level_vocab, "no-such-pre")
    with caplog.at_level(logging.WARNING):
        tokenizer, _ = _load(path, tmp_path / "folder")
    assert "no-such-pre" in caplog.text
    gpt2, _ = _load(
        _byte_level_gguf(tmp_path / "g.gguf", byte_level_vocab, "gpt-2"), tmp_path / "g"
    )
    for text in (*TEXTS, *NUMBERS):
        assert tokenizer.encode(text) == gpt2.encode(text)


def test_missing_pre_uses_llama_cpp_default_with_a_warning(
    tmp_path: Path, byte_level_vocab, caplog: pytest.LogCaptureFixture
) -> None:
    # llama.cpp's 'default': punctuation runs isolated, GPT-2's split, digit runs isolated,
    # then cut in threes.
    path = _byte_level_gguf(tmp_path / "bpe.gguf", byte_level_vocab, None)
    with caplog.at_level(logging.WARNING):
        tokenizer, _ = _load(path, tmp_path / "folder")
    assert "tokenizer.ggml.pre" in caplog.text
    assert _splits(tokenizer, "x 1234567 a +b") == [
        "x",
        "Ġ",
        "123",
        "456",
        "7",
        "Ġa",
        "Ġ",
        "+",
        "b",
    ]


# -- llama kind: SentencePiece --------------------------------------------------------------

SPM_CORPUS = (
    "SentencePiece splits text into pieces learned from data.",
    "The pieces carry scores, and merging follows the best score.",
    "Spaces become a meta symbol, and a space is added in front of the text.",
    "Hello world, hello there, hello again!",
    "Unknown characters fall back to their bytes.",
    "Numbers 1 2 3 and 10 20 30 are split into digits.",
    "Lowercase and Uppercase Words, words, WORDS.",
    "A tokenizer that agrees with llama.cpp is a tokenizer we can trust.",
) * 3
SPM_TEXTS = (
    "Hello world",
    "hello there, hello again!",
    " leading space",
    "   three leading spaces",
    "multiple   spaces    inside",
    "trailing spaces   ",
    "new\nlines\n\nand\ttabs",
    "unknown: 漢字 ✨ žluťoučký кот 🙂",
    "Numbers 12345 and 3.14",
    "The <sep> marker",
    "x",
    "",
)
USER_DEFINED = "<sep>"


@dataclass(frozen=True)
class SentencePieceCase:
    sp: spm.SentencePieceProcessor
    tokenizer: Tokenizer
    info: GGUFTokenizerInfo
    path: Path


def _sentencepiece_case(root: Path, add_prefix: bool) -> SentencePieceCase:
    """A SentencePiece BPE model with byte fallback, trained here, and a GGUF holding its
    pieces, scores and types as llama.cpp's converter writes them."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_prefix,
        split_digits=True,
        user_defined_symbols=[USER_DEFINED],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    size = sp.get_piece_size()

    def token_type(i: int) -> int:
        # llama.cpp's converter: UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6.
        if sp.IsUnknown(i):
            return 2
        if sp.IsControl(i):
            return 3
        if sp.IsUnused(i):
            return 5
        if sp.IsByte(i):
            return 6
        return 4 if sp.IdToPiece(i) == USER_DEFINED else 1

    def tokenizer(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([sp.IdToPiece(i) for i in range(size)])
        writer.add_token_scores([sp.GetScore(i) for i in range(size)])
        writer.add_token_types([token_type(i) for i in range(size)])
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        if not add_prefix:  # llama.cpp's default for SentencePiece is a prefix space
            writer.add_add_space_prefix(False)

    root.mkdir()
    path = _write_gguf(root / "spm.gguf", size, tokenizer)
    loaded, info = _load(path, root / "folder")
    return SentencePieceCase(sp, loaded, info, path)


@pytest.fixture(scope="module")
def sentencepiece_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, SentencePieceCase]:
    """By add_dummy_prefix (tokenizer.ggml.add_space_prefix): on and off."""
    root = tmp_path_factory.mktemp("spm")
    return {flag: _sentencepiece_case(root / str(flag), flag) for flag in (True, False)}


@pytest.mark.parametrize("add_prefix", [True, False], ids=["prefix", "no-prefix"])
def test_sentencepiece_gguf_matches_sentencepiece(sentencepiece_cases, add_prefix: bool) -> None:
    case = sentencepiece_cases[add_prefix]
    sp, tokenizer, info = case.sp, case.tokenizer, case.info
    assert any(sp.IsByte(i) for i in range(sp.get_piece_size()))
    for text in SPM_TEXTS:
        if USER_DEFINED in text:
            continue  # llama.cpp treats it as an added token (see the next test)
        ids = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert tokenizer.encode(text) == [sp.bos_id(), *ids], text
        assert tokenizer.decode(ids) == sp.decode(ids) == text
        assert tokenizer.decode([sp.bos_id(), *ids, sp.eos_id()]) == text
    assert (info.kind, info.bos_token, info.eos_token) == ("llama", "<s>", "</s>")
    assert info.stop_token_ids == (2,)
    assert info.vocab_size == sp.get_piece_size()
    # byte fallback really happened: 漢 is three byte pieces
    assert [sp.IdToPiece(i) for i in tokenizer.encode("漢", add_special_tokens=False)][-3:] == [
        "<0xE6>",
        "<0xBC>",
        "<0xA2>",
    ]


@pytest.mark.parametrize("add_prefix", [True, False], ids=["prefix", "no-prefix"])
def test_sentencepiece_gguf_added_tokens(sentencepiece_cases, add_prefix: bool) -> None:
    case = sentencepiece_cases[add_prefix]
    sp, tokenizer = case.sp, case.tokenizer
    sep = sp.PieceToId(USER_DEFINED)
    ids = tokenizer.encode("The<sep>marker</s>", add_special_tokens=False)
    assert ids.count(sep) == 1
    assert ids[-1] == sp.eos_id()
    assert sep not in tokenizer.all_special_ids
    assert {sp.bos_id(), sp.eos_id(), sp.unk_id()} <= tokenizer.all_special_ids
    # llama.cpp starts every stretch of text after an added token with the prefix space
    # (sentencepiece's own encode adds it to "marker" here).
    assert ids[ids.index(sep) + 1 : -1] == sp.encode("marker")
    assert tokenizer.decode(ids) == ("The<sep> marker" if add_prefix else "The<sep>marker")


def test_sentencepiece_gguf_matches_transformers(sentencepiece_cases) -> None:
    # transformers builds a Metaspace pre-tokenizer that adds no second ▁ in front of text
    # that already starts with a space, and ignores add_space_prefix; llama.cpp and
    # sentencepiece do both, so only the file with the prefix and the texts where the
    # three agree are compared.
    case = sentencepiece_cases[True]
    hf = _transformers_tokenizer(case.path)
    texts = [t for t in SPM_TEXTS if not t.startswith(" ") and USER_DEFINED not in t]
    assert not _mismatches(case.tokenizer.encode, hf.encode, texts)
    for text in texts:
        ids = case.tokenizer.encode(text)
        assert case.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


# -- bad input ------------------------------------------------------------------------------


def test_gguf_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bare.gguf", 8, None)
    with pytest.raises(ValueError, match=r"has no tokenizer.*--tokenizer FOLDER"):
        write_gguf_tokenizer(gguf.GGUFReader(path), tmp_path / "folder")
    no_tokens = _write_gguf(tmp_path / "no_tokens.gguf", 8, lambda w: w.add_tokenizer_model("gpt2"))
    with pytest.raises(ValueError, match=r"has no tokenizer.*--tokenizer FOLDER"):
        write_gguf_tokenizer(gguf.GGUFReader(no_tokens), tmp_path / "folder")
    assert not (tmp_path / "folder" / "tokenizer.json").exists()


@pytest.mark.parametrize("kind", ["bert", "rwkv", "t5"])
def test_unsupported_tokenizer_kind_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    def tokenizer(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(kind)
        writer.add_token_list(["[UNK]", "a", "b"])
        writer.add_token_types([2, 1, 1])

    path = _write_gguf(tmp_path / f"{kind}.gguf", 3, tokenizer)
    with pytest.raises(ValueError, match=rf"kind '{kind}'.*supported kinds: gpt2, llama"):
        write_gguf_tokenizer(gguf.GGUFReader(path), tmp_path / "folder")


def test_named_chat_templates_are_kept_verbatim(tmp_path: Path, byte_level_vocab) -> None:
    # llama.cpp's converter writes a template list as tokenizer.chat_template (default)
    # plus tokenizer.chat_template.<name>.
    default = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    tool_use = "{{ tools | length }} tools: {{ messages[0]['content'] }}"
    tokens, merges = byte_level_vocab

    def tokenizer(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_chat_template(
            [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
        )

    path = _write_gguf(tmp_path / "t.gguf", len(tokens), tokenizer)
    loaded, info = _load(path, tmp_path / "folder")
    assert (info.bos_token_id, info.eos_token_id) == (None, None)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.chat_template == default
    assert loaded.apply_chat_template(messages) == "<|im_start|>hi<|im_end|>"
    assert loaded.apply_chat_template(messages, tools=[{"type": "function"}]) == "1 tools: hi"
