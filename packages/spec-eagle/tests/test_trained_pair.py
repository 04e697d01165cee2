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
        speculative_disable_by_batch_size=64,  # draft at every batch size
        speculative_num_draft_tokens=ndt,
    ) as engine:
        out = engine.generate(_prompts(), GREEDY)
        accept = engine.get_server_info()["avg_spec_accept_length"]
    assert [r["output_ids"] for r in out] == reference
    assert accept > 1.5


def test_speculation_turns_off_for_a_large_batch_and_back_on(
    reference: list[list[int]],
) -> None:
    """Requests of 10, 20, 30 and 40 tokens: the batch shrinks from four to one. Below
    three requests a step drafts, from three on it drafts nothing; the draft's state
    stays right across the switches (greedy output equal), and fewer drafts are
    accepted than with speculation always on."""
    lens = [10, 20, 30, 40]
    params = [{**GREEDY, "max_new_tokens": n} for n in lens]
    accept = {}
    for limit in (3, 100):
        with Engine(
            model_path=str(PAIR / "target"),
            dtype="float32",
            device="cpu",
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(PAIR / "eagle3"),
            speculative_disable_by_batch_size=limit,
        ) as engine:
            out = engine.generate(_prompts(), params)
            accept[limit] = engine.get_server_info()["avg_spec_accept_length"]
        want = [ref[:n] for ref, n in zip(reference, lens, strict=True)]
        assert [r["output_ids"] for r in out] == want
    assert 1.0 < accept[3] < accept[100]


def test_the_int8_head_drafts_like_the_float_one() -> None:
    """On the CPU the head is held in weight-only int8 (``quantize_int8``); its logits
    stay within 2 % of the float head's largest."""
    import torch
    from torch import nn

    from tandem.scheduler.kernels import cpu_build
    from tandem.scheduler.models import ModelConfig
    from tandem.scheduler.models.tiny import cache_root
    from tandem.scheduler.models.weights import load_model
    from tandem.spec_eagle.draft_model import load_draft_model

    assert cpu_build.load_cpu_kernels(cache_root() / "kernels")
    folder = PAIR / "target"
    target = load_model(
        folder, ModelConfig.from_pretrained(folder), dtype=torch.float32, device="cpu"
    )
    draft = load_draft_model(
        PAIR / "eagle3", target, algorithm="EAGLE3", dtype=torch.float32, device=torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, draft.config.hidden_size, generator=gen)
    features = torch.randn(7, 3 * draft.config.hidden_size, generator=gen)
    want_logits, want_fc = draft.compute_logits(hidden), draft.fc(features)
    assert draft.quantize_int8()
    assert not draft.quantize_int8()  # once only
    assert not any(isinstance(m, nn.Linear) for m in draft.modules())
    for got, want in ((draft.compute_logits(hidden), want_logits), (draft.fc(features), want_fc)):
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
