"""The grammar backend over xgrammar: every kind compiles, bad input is a ValueError
naming its kind, the cache returns one object per grammar, and a matcher driven by
random allowed tokens produces text the grammar describes, on a byte-level BPE tokenizer
(the default model's) and on a SentencePiece-style one (byte fallback, ``▁`` spaces).
The tiny reference checkpoints of conftest.py carry no tokenizer, so they are not used."""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from byte_fallback import sentencepiece_backend
from tokenizers import AddedToken

from tandem.scheduler.models.tiny import (
    BOS_TOKEN,
    IM_START_TOKEN,
    default_model_path,
)
from tandem.scheduler.sampling.grammar import GrammarBackend, GrammarMatcher, apply_bitmask
from tandem.scheduler.text.tokenizer import Tokenizer

PADDING = 5  # the model's vocabulary is wider than the tokenizer's

# No maxLength on strings: xgrammar 0.2.8 lets length-bounded strings hold raw control
# characters, which is not JSON (test_bounded_strings_exclude_control_characters).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "[A-Z][a-z]{0,7}"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "note": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "note", "tags"],
}
EMAIL = r"[a-z]{2,5}@[a-z]{1,4}\.(com|org)"
ANSWER = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
TAGGED = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<call>",
        "content": {"type": "json_schema", "json_schema": PERSON},
        "end": "</call>",
    },
}
LEGACY_TAG = {
    "structures": [{"begin": "<call>", "schema": {"type": "integer"}, "end": "</call>"}],
    "triggers": ["<call>"],
}

GOOD = [
    ("json_schema", json.dumps(PERSON)),
    ("json_schema", "true"),
    ("regex", EMAIL),
    ("ebnf", ANSWER),
    ("structural_tag", json.dumps(TAGGED)),
    ("structural_tag", json.dumps(TAGGED["format"])),
    ("structural_tag", json.dumps(LEGACY_TAG)),
    ("structural_tag", json.dumps({**LEGACY_TAG, "type": "structural_tag"})),
]

BAD = [
    ("json_schema", '{"type": "object"', "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON object or boolean"),
    ("json_schema", '{"type": "foo"}', "unsupported schema"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "unsupported schema"),
    ("json_schema", '{"$ref": "#/nowhere"}', "unsupported schema"),
    ("regex", "(ab", "invalid regular expression"),
    ("regex", "a{3,1}", "invalid regular expression"),
    ("regex", r"(a)\1", "invalid regular expression"),
    ("ebnf", 'answer ::= "yes"', 'root rule with name "root" is not found'),
    ("ebnf", 'root ::= "yes', "invalid grammar"),
    ("ebnf", "root ::= missing", "invalid grammar"),
    ("ebnf", 'root ::= root "a"', "the grammar matches no text"),
    ("regex", r"[^\x00-\U0010FFFF]", "the grammar matches no text"),
    ("structural_tag", "{", "not valid JSON"),
    ("structural_tag", "[]", "must be a JSON object"),
    ("structural_tag", "{}", "must have a format field"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', "nope"),
    ("structural_tag", '{"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}', "begin"),
    ("structural_tag", '{"structures": [], "triggers": ["<a>"]}', "non-empty list"),
    (
        "structural_tag",
        json.dumps({**LEGACY_TAG, "triggers": ["<other>"]}),
        "does not match any trigger",
    ),
]


@dataclass
class Case:
    backend: GrammarBackend
    tokenizer: Tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def sentencepiece_folder(folder: Path) -> Path:
    """A Llama 2 style checkpoint tokenizer: ``▁`` for spaces, byte-fallback pieces for
    characters outside the vocabulary, ``<unk>``, ``<s>`` and ``</s>`` special."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz0123456789"]
    pieces += ["▁a", "re", "ed", "gr", "een", '"name', '":', "▁[", "],", "ag", "es"]
    backend = sentencepiece_backend(pieces)
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def default_folder() -> Path:
    return default_model_path()


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def case(
    request: pytest.FixtureRequest,
    default_folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Case:
    if request.param == "byte_level":
        folder = default_folder
    else:
        folder = sentencepiece_folder(tmp_path_factory.mktemp("sentencepiece"))
    tokenizer = Tokenizer.from_pretrained(folder)
    backend = GrammarBackend(folder, tokenizer.vocab_size + PADDING, tokenizer.eos_token_ids)
    return Case(backend, tokenizer)


@pytest.fixture(scope="module")
def byte_level(default_folder: Path) -> Case:
    tokenizer = Tokenizer.from_pretrained(default_folder)
    backend = GrammarBackend(
        default_folder, tokenizer.vocab_size + PADDING, tokenizer.eos_token_ids
    )
    return Case(backend, tokenizer)


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    return [t for t in range(vocab_size) if int(bitmask[row, t // 32]) >> (t % 32) & 1]


def random_walk(case: Case, matcher: GrammarMatcher, seed: int, limit: int = 2000) -> list[int]:
    """Feed ``matcher`` tokens drawn uniformly from those it allows until it
    terminates; the ids, stop token included."""
    rng = np.random.default_rng(seed)
    bitmask = case.backend.new_bitmask(2)
    ids: list[int] = []
    while not matcher.terminated:
        assert len(ids) < limit, f"no termination after {limit} tokens: {case.decode(ids)!r}"
        matcher.fill(bitmask, 1)
        allowed = allowed_tokens(bitmask, 1, case.backend.vocab_size)
        token = int(rng.choice(allowed))
        assert matcher.accept(token)
        ids.append(token)
    assert ids[-1] in case.tokenizer.eos_token_ids
    return ids


def check_person(value: Any) -> None:
    """PERSON's constraints, checked by hand (and by jsonschema where installed)."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(value, PERSON)
    assert isinstance(value, dict)
    assert {"name", "age", "note", "tags"} <= set(value) <= set(PERSON["properties"])
    assert re.fullmatch("[A-Z][a-z]{0,7}", value["name"])
    assert type(value["age"]) is int
    assert 0 <= value["age"] <= 120
    assert isinstance(value["note"], str)
    assert isinstance(value["tags"], list)
    assert len(value["tags"]) <= 3
    assert all(tag in ("red", "green") for tag in value["tags"])
    assert type(value.get("ok", True)) is bool


@pytest.mark.parametrize(("kind", "text"), GOOD)
def test_every_kind_compiles(case: Case, kind: str, text: str) -> None:
    compiled = case.backend.compile(kind, text)
    assert compiled.kind == kind
    assert not case.backend.matcher(compiled).terminated


@pytest.mark.parametrize(("kind", "text", "detail"), BAD)
def test_bad_input_is_a_value_error_naming_its_kind(
    byte_level: Case, kind: str, text: str, detail: str
) -> None:
    with pytest.raises(ValueError, match=f"^{kind}: .*{re.escape(detail)}"):
        byte_level.backend.compile(kind, text)
    with pytest.raises(ValueError, match=f"^{kind}: "):  # failures are not cached
        byte_level.backend.compile(kind, text)


def test_error_messages_drop_xgrammars_source_locations(byte_level: Case) -> None:
    with pytest.raises(ValueError, match=r"^regex: ") as info:
        byte_level.backend.compile("regex", "(ab")
    message = str(info.value)
    assert message.startswith("regex: invalid regular expression: Regex parsing error")
    assert ".cc:" not in message
    assert "Check failed" not in message


def test_unknown_kind_and_non_string_text(byte_level: Case) -> None:
    with pytest.raises(ValueError, match=r"^grammar: not a grammar kind"):
        byte_level.backend.compile("grammar", "root ::= 'a'")
    with pytest.raises(ValueError, match=r"^regex: must be a string"):
        byte_level.backend.compile("regex", 5)  # type: ignore[arg-type]


def test_cache_returns_one_object_per_grammar(default_folder: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(default_folder)
    backend = GrammarBackend(
        default_folder, tokenizer.vocab_size, tokenizer.eos_token_ids, cache_size=2
    )
    text = 'root ::= "a"'  # a grammar, and a regular expression matching itself
    first = backend.compile("ebnf", text)
    assert backend.compile("ebnf", text) is first
    as_regex = backend.compile("regex", text)
    assert as_regex is not first  # the kind is part of the key
    assert backend.compile("ebnf", text) is first  # now the most recently used
    backend.compile("regex", "b+")  # evicts the least recently used, ("regex", text)
    assert backend.compile("ebnf", text) is first
    assert backend.compile("regex", text) is not as_regex
    uncached = GrammarBackend(default_folder, tokenizer.vocab_size, [], cache_size=0)
    assert uncached.compile("regex", "a+") is not uncached.compile("regex", "a+")


def test_concurrent_compiles_of_one_grammar_share_the_result(default_folder: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(default_folder)
    backend = GrammarBackend(default_folder, tokenizer.vocab_size, tokenizer.eos_token_ids)
    results: list[object] = []
    barrier = threading.Barrier(6)

    def compile_it(text: str) -> None:
        barrier.wait()
        results.append(backend.compile("json_schema", text))

    texts = [json.dumps(PERSON)] * 4 + ['{"type": "integer"}', '{"type": "string"}']
    threads = [threading.Thread(target=compile_it, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6
    assert len({id(r) for r in results}) == 3


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_under_a_json_schema_gives_valid_json(case: Case, seed: int) -> None:
    matcher = case.backend.matcher(case.backend.compile("json_schema", json.dumps(PERSON)))
    ids = random_walk(case, matcher, seed)
    check_person(json.loads(case.decode(ids[:-1])))


@pytest.mark.parametrize("spaces", [0, 2])
def test_json_whitespace_is_bounded(default_folder: Path, spaces: int) -> None:
    tokenizer = Tokenizer.from_pretrained(default_folder)
    backend = GrammarBackend(
        default_folder, tokenizer.vocab_size, tokenizer.eos_token_ids, json_max_whitespace=spaces
    )
    case = Case(backend, tokenizer)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}, "b": {"enum": [1]}},
        "required": ["a", "b"],
    }
    for seed in range(4):
        matcher = backend.matcher(backend.compile("json_schema", json.dumps(schema)))
        text = case.decode(random_walk(case, matcher, seed)[:-1])
        if spaces == 0:
            assert text == json.dumps(json.loads(text))  # the compact layout
        else:
            assert max(map(len, re.findall(r"\s+", text)), default=0) <= spaces


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_under_a_regex_matches_it(case: Case, seed: int) -> None:
    matcher = case.backend.matcher(case.backend.compile("regex", EMAIL))
    ids = random_walk(case, matcher, seed)
    assert re.fullmatch(EMAIL, case.decode(ids[:-1]))


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_under_ebnf_matches_it(case: Case, seed: int) -> None:
    matcher = case.backend.matcher(case.backend.compile("ebnf", ANSWER))
    ids = random_walk(case, matcher, seed)
    assert re.fullmatch(r"(yes|no) [0-9][0-9]?", case.decode(ids[:-1]))


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_under_a_structural_tag(case: Case, seed: int) -> None:
    matcher = case.backend.matcher(case.backend.compile("structural_tag", json.dumps(TAGGED)))
    text = case.decode(random_walk(case, matcher, seed)[:-1])
    match = re.fullmatch(r"<call>(.*)</call>", text, flags=re.DOTALL)
    assert match is not None, text
    check_person(json.loads(match.group(1)))


def test_legacy_structural_tag_constrains_only_inside_the_tag(byte_level: Case) -> None:
    backend, tokenizer = byte_level.backend, byte_level.tokenizer
    compiled = backend.compile("structural_tag", json.dumps(LEGACY_TAG))
    matcher = backend.matcher(compiled)
    bitmask = backend.new_bitmask(1)
    for token in tokenizer.encode("the fox <call>", add_special_tokens=False):
        assert matcher.accept(token)
    matcher.fill(bitmask, 0)
    inside = {byte_level.decode([t]) for t in allowed_tokens(bitmask, 0, backend.vocab_size)}
    assert "7" in inside
    assert "x" not in inside
    for token in tokenizer.encode("42</call> done", add_special_tokens=False):
        assert matcher.accept(token)
    for token in tokenizer.encode(" <call>", add_special_tokens=False):
        assert matcher.accept(token)
    assert not matcher.accept(ord("x"))
    assert not matcher.accept(min(backend.stop_token_ids))  # inside the tag
    for token in tokenizer.encode("-1</call>", add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.accept(min(backend.stop_token_ids))
    assert matcher.terminated


def test_special_tokens_only_under_structural_tags(byte_level: Case) -> None:
    backend, tokenizer = byte_level.backend, byte_level.tokenizer
    im_start = tokenizer.token_to_id(IM_START_TOKEN)
    bos = tokenizer.token_to_id(BOS_TOKEN)
    assert im_start is not None
    assert bos is not None
    bitmask = backend.new_bitmask(1)
    free = backend.matcher(backend.compile("regex", r"(.|\n)*"))
    free.fill(bitmask, 0)
    allowed = set(allowed_tokens(bitmask, 0, backend.vocab_size))
    assert ord("a") in allowed
    assert im_start not in allowed
    assert bos not in allowed
    assert not free.accept(im_start)
    token_tag = {"type": "structural_tag", "format": {"type": "token", "token": IM_START_TOKEN}}
    tagged = backend.matcher(backend.compile("structural_tag", json.dumps(token_tag)))
    tagged.fill(bitmask, 0)
    assert allowed_tokens(bitmask, 0, backend.vocab_size) == [im_start]
    assert tagged.accept(im_start)


def test_padding_ids_are_never_allowed(case: Case) -> None:
    vocab_size = case.backend.vocab_size
    padding = range(case.tokenizer.vocab_size, vocab_size)
    matcher = case.backend.matcher(case.backend.compile("regex", r"(.|\n)*"))
    bitmask = case.backend.new_bitmask(1)
    matcher.fill(bitmask, 0)
    allowed = set(allowed_tokens(bitmask, 0, vocab_size))
    assert allowed.isdisjoint(padding)
    assert case.tokenizer.eos_token_ids <= allowed
    assert all(not matcher.accept(t) for t in [*padding, vocab_size, -1])


@pytest.mark.parametrize(
    "bounds", [{"maxLength": 4}, {"minLength": 1}, {"minLength": 0, "maxLength": 9}]
)
def test_bounded_strings_exclude_control_characters(
    byte_level: Case, bounds: dict[str, int]
) -> None:
    """xgrammar 0.2.8 and 0.2.9 admit raw control characters in length-bounded strings;
    the backend rewrites such strings as a pattern of plain characters."""
    schema = json.dumps({"type": "string", **bounds})
    matcher = byte_level.backend.matcher(byte_level.backend.compile("json_schema", schema))
    assert matcher.accept(ord('"'))
    bitmask = byte_level.backend.new_bitmask(1)
    matcher.fill(bitmask, 0)
    assert set(allowed_tokens(bitmask, 0, 32)) == set()  # byte ids 0-31 are the controls


def test_rollback_restores_the_state(case: Case) -> None:
    backend = case.backend
    compiled = backend.compile("json_schema", json.dumps(PERSON))
    ids = random_walk(case, backend.matcher(compiled), 7)
    count = len(ids)
    before = backend.new_bitmask(count)  # before[i]: the mask before accepting ids[i]
    matcher = backend.matcher(compiled)
    for i, token in enumerate(ids):
        matcher.fill(before, i)
        assert matcher.accept(token)
    assert matcher.terminated
    now = backend.new_bitmask(1)

    def at(position: int) -> bool:
        matcher.fill(now, 0)
        return torch.equal(now[0], before[position])

    matcher.rollback(0)
    assert matcher.terminated
    matcher.rollback(1)  # the stop token
    assert not matcher.terminated
    assert matcher.completed
    assert at(count - 1)
    matcher.rollback(3)
    assert not matcher.completed
    assert at(count - 4)
    for token in ids[count - 4 :]:
        assert matcher.accept(token)
    assert matcher.terminated
    matcher.rollback(count)
    assert at(0)
    with pytest.raises(ValueError, match=r"^rollback: "):
        matcher.rollback(1)
    with pytest.raises(ValueError, match=r"^rollback: "):
        matcher.rollback(-1)


def test_terminated_matcher_allows_only_stop_tokens(case: Case) -> None:
    matcher = case.backend.matcher(case.backend.compile("ebnf", 'root ::= "no"'))
    ids = random_walk(case, matcher, 0)
    assert case.decode(ids[:-1]) == "no"
    bitmask = case.backend.new_bitmask(3)
    matcher.fill(bitmask, 2)
    stops = case.backend.stop_token_ids
    assert allowed_tokens(bitmask, 2, case.backend.vocab_size) == sorted(stops)
    assert torch.all(bitmask[:2] == -1)
    assert not matcher.accept(stops[0])
    assert matcher.terminated


def test_without_stop_tokens_a_matcher_ends_with_its_grammar(default_folder: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(default_folder)
    backend = GrammarBackend(default_folder, tokenizer.vocab_size, eos_ids=[])
    matcher = backend.matcher(backend.compile("regex", "ab"))
    assert matcher.accept(ord("a"))
    assert not matcher.terminated
    assert matcher.accept(ord("b"))
    assert matcher.terminated
    bitmask = backend.new_bitmask(1)
    bitmask.zero_()
    matcher.fill(bitmask, 0)
    assert torch.all(bitmask == -1)


def test_new_bitmask_shape(case: Case) -> None:
    bitmask = case.backend.new_bitmask(3)
    assert bitmask.shape == (3, math.ceil(case.backend.vocab_size / 32))
    assert bitmask.dtype == torch.int32
    assert bitmask.device.type == "cpu"
    assert torch.all(bitmask == -1)


def test_the_backend_reads_the_tokenizer_on_first_use(tmp_path: Path) -> None:
    backend = GrammarBackend(tmp_path / "missing", 100, [0])
    assert backend.new_bitmask(1).shape == (1, 4)
    with pytest.raises(FileNotFoundError):
        backend.compile("regex", "a")


def expected_masking(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None
) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(range(logits.shape[0]) if rows is None else rows):
        for token in range(logits.shape[1]):
            word = token // 32
            if word >= bitmask.shape[1] or not (int(bitmask[i, word]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [None, [0, 1, 2, 3, 4], [1, 3], [4, 0, 2], [0, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_apply_bitmask_sets_exactly_the_disallowed_logits(
    rows: list[int] | None, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(3)
    vocab = 70  # three words, the last one partly used
    bitmask = torch.randint(-(2**31), 2**31, (5, 3), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    for width in (vocab, 96, 100):  # logits as wide as the vocab, the mask, or wider
        logits = torch.randn(5, width, generator=generator).to(dtype)
        expected = expected_masking(logits, bitmask, rows)
        apply_bitmask(logits, bitmask, rows)
        assert torch.equal(logits, expected)


def test_apply_bitmask_on_a_strided_view_and_with_no_rows() -> None:
    bitmask = torch.zeros(2, 1, dtype=torch.int32)
    bitmask[:, 0] = 0b101
    storage = torch.zeros(4, 64)
    logits = storage[::2, :32]
    apply_bitmask(logits, bitmask)
    assert torch.isinf(storage[0, 1])
    assert storage[0, 2] == 0
    assert torch.isinf(storage[0, 31])
    assert torch.all(storage[1] == 0)
    assert torch.all(storage[:, 32:] == 0)
    before = storage.clone()
    apply_bitmask(storage, bitmask, rows=[])
    assert torch.equal(storage, before)
    with pytest.raises(ValueError, match="rows to mask"):
        apply_bitmask(storage, bitmask, rows=[0, 1, 2])
