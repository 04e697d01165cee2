"""Constrained decoding through the Engine, with the tiny test model (whose
unconstrained output is gibberish, so a valid output cannot be luck): every output
parses and validates, over seeds and temperatures, on both loops, with chunked prefill
and under retraction; the two loops give the same greedy tokens; unconstrained rows in
the same batch are untouched; bad grammars are refused before anything is queued."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from engine_checks import idle_clean

from tandem.scheduler import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "alan", "grace"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)\."
EBNF = 'root ::= "(" item (" " item)? (" " item)? ")"\nitem ::= "a" | "bb" | "ccc"'
PROMPTS = ["Once upon a time", "The king said", "ROMEO:", "Tell me about"]


def _valid(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "tags"}
        and value["name"] in SCHEMA["properties"]["name"]["enum"]  # type: ignore[index]
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 99
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
        and all(isinstance(t, bool) for t in value["tags"])
    )


def _engine(**options: Any) -> Engine:
    return Engine(model_path="tandem-tiny", device="cpu", debug_futures=True, **options)


def _params(kind: str, temperature: float, seed: int | None) -> dict[str, Any]:
    grammar = {"json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf": EBNF}[kind]
    return {"max_new_tokens": 160, "temperature": temperature, "seed": seed, kind: grammar}


def _check(kind: str, out: dict[str, Any]) -> None:
    text = out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop", (kind, text)
    if kind == "json_schema":
        assert _valid(json.loads(text)), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"\((a|bb|ccc)( (a|bb|ccc)){0,2}\)", text), text


@pytest.mark.parametrize("normal_loop", [False, True])
def test_every_constrained_output_is_valid(normal_loop: bool) -> None:
    cases = [
        (kind, temperature, seed)
        for kind in ("json_schema", "regex", "ebnf")
        for temperature, seed in ((0.0, None), (0.7, 1), (1.0, 2), (1.5, 3))
    ]
    with _engine(disable_overlap_schedule=normal_loop, chunked_prefill_size=3) as engine:
        # Constrained and free requests share the batches.
        params = [_params(*case) for case in cases] + [{"max_new_tokens": 12, "temperature": 1.0}]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
        outs = engine.generate(prompts, params)
        idle_clean(engine)
    for case, out in zip(cases, outs, strict=False):
        _check(case[0], out)
    assert len(outs[-1]["output_ids"]) == 12


BOUNDED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "minLength": 2, "maxLength": 3},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["city", "code", "notes"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("normal_loop", [False, True])
def test_length_bounded_strings_are_json_strings(normal_loop: bool) -> None:
    """xgrammar alone lets raw control characters into strings with maxLength; the
    tiny model samples them readily at high temperature. Every output is strict JSON
    (``json.loads`` refuses raw controls in strings) and keeps the bounds."""
    schema = json.dumps(BOUNDED)
    params = [
        {"max_new_tokens": 400, "temperature": 1.5, "seed": seed, "json_schema": schema}
        for seed in range(24)
    ]
    with _engine(disable_overlap_schedule=normal_loop) as engine:
        outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
        idle_clean(engine)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        value = json.loads(out["text"])
        assert len(value["city"]) <= 12
        assert 2 <= len(value["code"]) <= 3
        assert len(value["notes"]) <= 2
        assert all(len(note) <= 5 for note in value["notes"])


def test_greedy_is_the_same_on_both_loops_and_free_rows_are_untouched() -> None:
    constrained = _params("json_schema", 0.0, None)
    free = {"max_new_tokens": 16, "temperature": 0.0}
    results = []
    for normal_loop in (False, True):
        with _engine(disable_overlap_schedule=normal_loop) as engine:
            mixed = engine.generate(PROMPTS[:2], [constrained, free])
            alone = engine.generate(PROMPTS[1], free)
        results.append([r["output_ids"] for r in mixed])
        assert mixed[1]["output_ids"] == alone["output_ids"]
    assert results[0] == results[1]


def test_constrained_requests_survive_retraction() -> None:
    params = [_params("json_schema", 0.9, seed) for seed in range(6)]
    with _engine(max_total_tokens=260, page_size=4) as engine:
        outs = engine.generate([PROMPTS[i % 4] for i in range(6)], params)
        assert engine.scheduler.counters.retracted_requests > 0
        idle_clean(engine)
    for out in outs:
        _check("json_schema", out)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": 'start ::= "a"'}, "ebnf"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one of"),
    ],
)
def test_bad_grammars_are_refused_before_anything_is_queued(
    params: dict[str, Any], message: str
) -> None:
    with _engine() as engine:
        with pytest.raises(ValueError, match=message):
            engine.generate(PROMPTS[:2], [{"max_new_tokens": 4}, params])
        assert not engine.scheduler.has_work()
        assert engine.generate(PROMPTS[0], {"max_new_tokens": 3})["output_ids"]


def test_a_forward_waiting_for_masks_counts_the_wait_as_idle() -> None:
    import torch

    from tandem.scheduler.runner.timeline import Timeline

    timeline = Timeline(torch.device("cpu"))
    handle = timeline.begin(new_period=True)
    time.sleep(0.02)
    timeline.stall(0.015)  # the forward thread waited this long for the host's masks
    timeline.end(handle)
    assert timeline.idle_s == pytest.approx(0.015)
    assert 0.0 < timeline.busy_s < 0.02


@pytest.mark.parametrize("normal_loop", [False, True])
def test_tensor_parallel_ranks_share_the_masks(normal_loop: bool) -> None:
    """Rank 0 writes the masks; the other rank waits for them at sampling too (sent
    after the launch on the overlap loop, with it on the normal loop)."""
    params = [_params("json_schema", 0.0, None), _params("regex", 0.8, 5)]
    params.append({"max_new_tokens": 10, "temperature": 0.0})
    outs = []
    for tp_size in (1, 2):
        with _engine(tp_size=tp_size, disable_overlap_schedule=normal_loop) as engine:
            outs.append(engine.generate(PROMPTS[:3], params))
            idle_clean(engine)
    _check("json_schema", outs[1][0])
    _check("regex", outs[1][1])
    assert [r["output_ids"] for r in outs[0]] == [r["output_ids"] for r in outs[1]]
