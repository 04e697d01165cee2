"""IncrementalDetokenizer streams text that is always whole characters and adds up to
the full decode, on a byte-level tokenizer (multi-byte characters split across byte
tokens) and on a SentencePiece-style one (leading-space stripping, byte fallback)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from byte_fallback import sentencepiece_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.detokenizer import IncrementalDetokenizer
from tandem.scheduler.text.tokenizer import SpecialTokens, Tokenizer

REPLACEMENT = "\ufffd"

# Letters, spaces, newlines, accents, CJK, emoji (4 bytes, some with modifiers and ZWJ).
TEXT_ALPHABET = st.sampled_from(
    list("abcdefghij XYZ.,!?\n\t'")
    + list("éüßñ")
    + list("你好世界日本語한국어")
    + ["😀", "👍🏽", "👩‍💻", "🇫🇷", "€", "Ω", "\u0301"]
)
texts = st.lists(TEXT_ALPHABET, max_size=30).map("".join)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path(tmp_path_factory.mktemp("cache")))


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama 2 style pipeline: ``▁`` for spaces, a leading ``▁`` stripped on decode,
    byte-fallback tokens for characters outside the (character-level) vocabulary."""
    backend = sentencepiece_backend(["▁", *"abcdefghijklmnopqrstuvwxyzXYZ.,!?'\n"])
    return Tokenizer(
        backend,
        special_tokens=SpecialTokens(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        chat_templates={},
        eos_token_ids=frozenset({2}),
    )


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], cuts: Sequence[int]
) -> tuple[list[str], str]:
    """Feed ``ids`` in steps of the sizes in ``cuts`` (cycled); return the chunks and
    what flush emitted."""
    chunks = []
    start = 0
    sizes = [max(1, c) for c in cuts] or [1]
    i = 0
    while start < len(ids):
        size = sizes[i % len(sizes)]
        chunks.append(detok.step(list(ids[start : start + size])))
        start += size
        i += 1
    return chunks, detok.flush()


def test_emoji_split_across_byte_tokens_waits_for_the_last_byte(
    byte_tokenizer: Tokenizer,
) -> None:
    ids = byte_tokenizer.encode("😀", add_special_tokens=False)
    assert ids == list("😀".encode())  # one token per byte: ids 0-255 are the bytes
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert [detok.step([i]) for i in ids] == ["", "", "", "😀"]
    assert detok.flush() == ""
    assert detok.output_text == "😀"


def test_text_before_a_partial_character_is_held_then_released(
    byte_tokenizer: Tokenizer,
) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert detok.step(byte_tokenizer.encode("ok ", add_special_tokens=False)) == "ok "
    first, *rest = "你".encode()
    assert detok.step([byte_tokenizer.encode("a", False)[0], first]) == ""
    assert detok.step(rest) == "a你"


def test_flush_emits_a_truncated_character_as_the_full_decode_does(
    byte_tokenizer: Tokenizer,
) -> None:
    ids = [*byte_tokenizer.encode("hi ", add_special_tokens=False), *"😀".encode()[:2]]
    detok = IncrementalDetokenizer(byte_tokenizer)
    chunks, tail = stream(detok, ids, [1])
    assert "".join(chunks) == "hi "
    assert tail == REPLACEMENT
    assert detok.output_text == byte_tokenizer.decode(ids) == "hi " + REPLACEMENT


def test_special_tokens_are_skipped_or_kept(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(byte_tokenizer, skip_special_tokens=skip)
        chunks, tail = stream(detok, ids, [1])
        assert "".join(chunks) + tail == byte_tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == "<|im_start|>hi<|im_end|>"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(0, 428), max_size=40),
    cuts=st.lists(st.integers(1, 5), max_size=6),
    skip=st.booleans(),
)
def test_random_ids_stream_to_the_full_decode(
    byte_tokenizer: Tokenizer, ids: list[int], cuts: list[int], skip: bool
) -> None:
    assert byte_tokenizer.vocab_size == 429
    full = byte_tokenizer.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(byte_tokenizer, skip_special_tokens=skip)
    chunks, tail = stream(detok, ids, cuts)
    assert "".join(chunks) + tail == full == detok.output_text
    for chunk in chunks:
        chunk.encode("utf-8")  # a whole character string: no lone surrogates
        assert REPLACEMENT not in chunk or REPLACEMENT in full


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=texts, text=texts, cuts=st.lists(st.integers(1, 4), max_size=6))
def test_text_streams_without_replacement_characters(
    byte_tokenizer: Tokenizer, prompt: str, text: str, cuts: list[int]
) -> None:
    prompt_ids = byte_tokenizer.encode(prompt)
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    for context in (None, prompt_ids):
        detok = IncrementalDetokenizer(byte_tokenizer, prompt_ids=context)
        chunks, tail = stream(detok, ids, cuts)
        assert all(REPLACEMENT not in chunk for chunk in [*chunks, tail])
        assert "".join(chunks) + tail == text == byte_tokenizer.decode(ids)


@settings(max_examples=200, deadline=None)
@given(prompt=texts, text=texts, cuts=st.lists(st.integers(1, 4), max_size=6))
def test_sentencepiece_style_leading_space_and_byte_fallback(
    prompt: str, text: str, cuts: list[int]
) -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer)
    chunks, tail = stream(detok, ids, cuts)
    assert "".join(chunks) + tail == full
    assert all(REPLACEMENT not in chunk for chunk in chunks)
    # After a prompt the first token keeps its leading space: the stream is exactly
    # what the prompt's text grows by.
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    chunks, tail = stream(detok, ids, cuts)
    joined = tokenizer.decode(prompt_ids + ids)
    assert "".join(chunks) + tail == joined[len(tokenizer.decode(prompt_ids)) :]


def test_sentencepiece_continuation_keeps_its_space() -> None:
    tokenizer = sentencepiece_tokenizer()
    prompt_ids = tokenizer.encode("hello", add_special_tokens=False)
    ids = tokenizer.encode("world 你", add_special_tokens=False)
    assert tokenizer.decode(ids) == "world 你"
    assert IncrementalDetokenizer(tokenizer).step(ids) == "world 你"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    assert [detok.step([i]) for i in ids][:3] == [" ", "w", "o"]
    assert detok.output_text == " world 你"


def test_empty_steps_and_repeated_flush(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, prompt_ids=[])
    assert detok.step([]) == ""
    assert detok.flush() == ""
    assert detok.step(byte_tokenizer.encode("x", False)) == "x"
    assert detok.flush() == ""
    assert detok.output_text == "x"


class _CountingTokenizer:
    """Wraps a tokenizer and counts ``decode`` calls."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.calls = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@given(text=texts)
@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_stop_checker_without_stop_strings_decodes_on_demand(
    byte_tokenizer: Tokenizer, text: str
) -> None:
    """No stop string to scan for: feeding tokens decodes nothing; the text asked for
    at the end is the whole decode, exactly as a token-by-token checker gives it."""
    from tandem.scheduler.text.stop import StopChecker

    ids = byte_tokenizer.encode(text)
    counting = _CountingTokenizer(byte_tokenizer)
    lazy = StopChecker([], IncrementalDetokenizer(counting))  # type: ignore[arg-type]
    eager = StopChecker(["\x00never"], IncrementalDetokenizer(byte_tokenizer))
    for token in ids:
        assert lazy.feed([token]) is None
        eager.feed([token])
    calls_after_feeding = counting.calls
    lazy.finish_text()
    eager.finish_text()
    assert calls_after_feeding <= 1  # at most the constructor's empty-prefix decode
    assert lazy.take_new_text(final=True) == eager.take_new_text(final=True)
    assert lazy.text == byte_tokenizer.decode(ids)
