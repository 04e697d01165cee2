"""Stop strings: the one-automaton matcher against a plain reference, and the limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.scheduler.text.stop import StopChecker, StopLimits, StopMatcher


class _Pieces:
    """A detokenizer stand-in: token id i decodes to ``pieces[i]``."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def step(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def flush(self) -> str:
        return ""


def _reference(chunks: list[str], stops: list[str]) -> tuple[str | None, str, list[int]]:
    """What the checker must do, by brute force: after each chunk, the earliest stop
    string occurrence (first listed on a tie) ends the text there; otherwise the tail
    that begins some stop string is held back."""
    text = ""
    held = []
    for chunk in chunks:
        text += chunk
        found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            at, _, s = min(found)
            return s, text[:at], held
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        held.append(len(text) - hold)
    return None, text, held


_TEXT = st.text(alphabet="abc", max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(_TEXT, min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=6),
)
def test_the_matcher_cuts_and_holds_where_a_brute_force_scan_does(
    chunks: list[str], stops: list[str]
) -> None:
    checker = StopChecker(stops, _Pieces(chunks))  # type: ignore[arg-type]
    matched = None
    safe_ends = []
    for i in range(len(chunks)):
        matched = checker.feed([i])
        if matched is not None:
            break
        safe_ends.append(checker._safe_end())
    want_matched, want_text, want_held = _reference(chunks, stops)
    assert matched == want_matched
    assert checker.text == want_text
    assert safe_ends == want_held


def test_the_stream_never_shows_part_of_a_stop_string() -> None:
    checker = StopChecker(["</answer>"], _Pieces(["The", " answer", "</ans", "wer>", "!"]))  # type: ignore[arg-type]
    shown = []
    for i in range(5):
        if checker.feed([i]) is not None:
            break
        shown.append(checker.take_new_text(final=False))
    shown.append(checker.take_new_text(final=True))
    assert shown == ["The", " answer", "", ""]
    assert checker.matched == "</answer>"


def test_a_step_reads_only_the_new_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many and long the strings, each step hands the automaton the new
    characters alone, once: a whole request reads its text once."""
    read: list[str] = []
    advance = StopMatcher.advance

    def counting(self: StopMatcher, state: int, text: str) -> tuple[int, int | None]:
        read.append(text)
        return advance(self, state, text)

    monkeypatch.setattr(StopMatcher, "advance", counting)
    pieces = ["word "] * 200
    stops = [f"{i:04d}" + "x" * 250 for i in range(64)]
    checker = StopChecker(stops, _Pieces(pieces))  # type: ignore[arg-type]
    for i in range(len(pieces)):
        checker.feed([i])
        checker.take_new_text(final=False)
    assert read == pieces


def test_requests_with_the_same_small_set_share_one_matcher() -> None:
    assert StopMatcher.of(("\n\n", "Q:")) is StopMatcher.of(("\n\n", "Q:"))
    big = tuple("y" * 1000 + str(i) for i in range(8))
    assert StopMatcher.of(big) is not StopMatcher.of(big)


@pytest.mark.parametrize(
    ("stops", "needle"),
    [
        (["s"] * 65, "65 stop strings, more than the limit of 64"),
        (["x" * 1025], "a stop string of 1025 characters, longer than the limit of 1024"),
    ],
)
def test_past_a_limit_the_error_names_it_and_the_flag(stops: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        StopLimits().check(stops)
    assert "--max-stop-string" in str(info.value)
    StopLimits(max_count=65, max_length=1025).check(stops)  # raised, it passes


def test_the_engine_refuses_past_its_limits_and_takes_them_raised() -> None:
    """The offline Engine checks the limits too (the server checks them before it
    tokenizes), and its options raise them."""
    from tandem.scheduler import Engine

    stops = [f"s{i}" for i in range(5)]
    params = {"max_new_tokens": 2, "stop": stops}
    engine = Engine(model_path="tandem-tiny", device="cpu", max_stop_strings=4)
    with engine, pytest.raises(ValueError, match="5 stop strings, more than the limit of 4"):
        engine.generate("x", params)
    with Engine(model_path="tandem-tiny", device="cpu", max_stop_strings=5) as engine:
        assert engine.generate("x", params)["meta_info"]["finish_reason"] is not None
