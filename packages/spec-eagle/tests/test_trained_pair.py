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


def test_speculation_turns_off_for_a_large_batch_and_back_on() -> None:
    """One request decodes alone, drafting; three more arrive, and from three decoding
    requests on the steps are plain, replayed by the decode trace: the first request
    too decodes plainly to its end. A request arriving after them all drafts again.
    Greedy output equals the target's own throughout."""
    prompts = _prompts()
    long = {**GREEDY, "max_new_tokens": 160}
    target = {"model_path": str(PAIR / "target"), "dtype": "float32", "device": "cpu"}
    with Engine(**target) as engine:
        want = [r["output_ids"] for r in engine.generate(prompts, [long] + [GREEDY] * 3)]
    with Engine(
        **target,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(PAIR / "eagle3"),
        speculative_disable_by_batch_size=3,
        speculative_disable_adaptive=True,  # the batch limit alone (the gate: test_engine_spec)
    ) as engine:
        stream = engine.generate(prompts[0], long, stream=True)
        chunks = [next(stream)]
        joined = engine.generate(prompts[1:], GREEDY)
        chunks += list(stream)
        replays = engine.scheduler.runner.decode_trace.replays
        again = engine.generate(prompts[0], GREEDY)
        assert engine.scheduler.runner.decode_trace.replays == replays  # it drafted
    first = [t for chunk in chunks for t in chunk["output_ids"]]
    assert first == want[0]
    assert [r["output_ids"] for r in joined] == want[1:]
    assert again["output_ids"] == want[0][: GREEDY["max_new_tokens"]]
    # The first request drafted alone; the three that joined never drafted.
    assert 0 < chunks[-1]["meta_info"]["spec_verify_ct"] < len(first)
    assert all(r["meta_info"]["spec_verify_ct"] == 0 for r in joined)
    assert replays > 0
    verify = again["meta_info"]["spec_verify_ct"]
    assert 0 < verify < len(again["output_ids"])  # drafts accepted again


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
