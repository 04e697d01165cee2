"""Constrained decoding with EAGLE: the worker masks every node of its draft tree by
what the grammar allows after the node's path, so outputs stay valid and greedy ones
equal plain constrained decoding, on both loops, chain and tree drafts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tandem.scheduler import Engine
from tandem.scheduler.models.tiny import default_model_path
from tandem.spec_eagle import write_random_head

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"enum": ["alpha", "beta", "gamma"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["word", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)( (red|green|blue)){1,4}\."
PROMPTS = ["Once upon a time", "The king said", "ROMEO:"]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("head")
    return write_random_head(default_model_path(), root / "eagle3", algorithm="EAGLE3", seed=3)


def _params(temperature: float, seed: int | None) -> list[dict[str, Any]]:
    base = {"max_new_tokens": 120, "temperature": temperature, "seed": seed}
    return [
        {**base, "json_schema": json.dumps(SCHEMA)},
        {**base, "regex": REGEX},
        {"max_new_tokens": 10, "temperature": temperature, "seed": seed},  # free
    ]


def _run(head: Path | None, normal_loop: bool, params: list[dict[str, Any]], **spec: Any) -> Any:
    options: dict[str, Any] = {
        "model_path": "tandem-tiny",
        "device": "cpu",
        "disable_overlap_schedule": normal_loop,
    }
    if head is not None:
        options |= {
            "speculative_algorithm": "EAGLE3",
            "speculative_disable_by_batch_size": 64,  # draft at every batch size
            "speculative_draft_model_path": str(head),
            **spec,
        }
    with Engine(debug_futures=True, **options) as engine:
        return engine.generate(PROMPTS, params)


def _check(outs: list[dict[str, Any]]) -> None:
    value = json.loads(outs[0]["text"])
    assert set(value) == {"word", "n", "ok"}
    assert value["word"] in ("alpha", "beta", "gamma")
    assert isinstance(value["ok"], bool)
    assert 0 <= value["n"] <= 999
    assert re.fullmatch(REGEX, outs[1]["text"]), outs[1]["text"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs[:2])


@pytest.mark.parametrize(
    ("normal_loop", "spec"),
    [
        (False, {"speculative_num_steps": 3, "speculative_eagle_topk": 1}),
        (True, {"speculative_num_steps": 3, "speculative_eagle_topk": 2}),
        (False, {"speculative_num_steps": 2, "speculative_eagle_topk": 3}),
    ],
)
def test_greedy_constrained_equals_plain_constrained(
    head: Path, normal_loop: bool, spec: dict[str, Any]
) -> None:
    params = _params(0.0, None)
    speculative = _run(head, normal_loop, params, **spec)
    _check(speculative)
    plain = _run(None, normal_loop, params)
    assert [o["output_ids"] for o in speculative] == [o["output_ids"] for o in plain]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_constrained_outputs_are_valid(head: Path, seed: int) -> None:
    spec = {"speculative_num_steps": 3, "speculative_eagle_topk": 2}
    _check(_run(head, False, _params(1.0, seed), **spec))


@pytest.mark.parametrize("normal_loop", [False, True])
def test_constrained_requests_decode_plainly_over_the_limit(head: Path, normal_loop: bool) -> None:
    """Three requests at the CPU's default limit (2): every decode step is plain, its
    masks written by the plain path, and greedy output equals plain constrained."""
    params = _params(0.0, None)
    speculative = _run(head, normal_loop, params, speculative_disable_by_batch_size=2)
    _check(speculative)
    assert all(o["meta_info"]["spec_verify_ct"] == 0 for o in speculative)
    plain = _run(None, normal_loop, params)
    assert [o["output_ids"] for o in speculative] == [o["output_ids"] for o in plain]
    _check(_run(head, normal_loop, _params(1.0, 5), speculative_disable_by_batch_size=2))
