"""The committed trained pair (``tools/eagle_pair``): real acceptance, so accepted
chains and accepted tree branches (with their KV moves) are exercised, and greedy
output still equals the target's own, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.scheduler import Engine

ROOT = Path(__file__).resolve().parents[3]
PAIR = ROOT / "tools" / "eagle_pair"
TEXT = ROOT / "tools" / "data" / "tinyshakespeare.txt"
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def _prompts() -> list[str]:
    held_out = TEXT.read_text(encoding="utf-8")[-6000:]
    return [held_out[i : i + 160] for i in (0, 1500, 3000, 4500)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with Engine(model_path=str(PAIR / "target"), dtype="float32", device="cpu") as engine:
        return [r["output_ids"] for r in engine.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize(
    ("topk", "ndt", "normal_loop"), [(1, 4, False), (2, 6, False), (2, 6, True)]
)
def test_trained_head_accepts_and_stays_exact(
    reference: list[list[int]], topk: int, ndt: int, normal_loop: bool
) -> None:
    with Engine(
        model_path=str(PAIR / "target"),
        dtype="float32",
        device="cpu",
        disable_overlap_schedule=normal_loop,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(PAIR / "eagle3"),
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    ) as engine:
        out = engine.generate(_prompts(), GREEDY)
        accept = engine.get_server_info()["avg_spec_accept_length"]
    assert [r["output_ids"] for r in out] == reference
    assert accept > 1.5
