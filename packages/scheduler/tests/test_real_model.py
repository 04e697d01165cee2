"""The real default model, SmolLM2-135M-Instruct (its Q4_1 GGUF), against transformers
reading the same file: greedy tokens over real chat prompts in both loops, with the
radix cache warm and the prompts prefilled in chunks, and prompt logprobs.

transformers dequantizes the GGUF with the same library tandem does, so both run the
same float32 weights; an honest near-tie is the only difference allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checks import idle_clean

from tandem.scheduler import Engine
from tandem.scheduler.text.tokenizer import Tokenizer

# A shared system turn, so that the radix cache holds a prefix the later prompts reuse.
SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
QUESTIONS = (
    "What is the capital of France?",
    "What is 12 plus 7?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What does a CPU do?",
)
NEW_TOKENS = 24
# Largest reference-logit gap between the two tokens at a divergence that counts as a tie.
TIE = 1e-3


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    from tandem.scheduler.models.source import resolve_model

    return Tokenizer.from_pretrained(resolve_model(str(smollm2_gguf)))


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    out = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            min_new_tokens=n, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _assert_same_or_tie(
    model: torch.nn.Module, prompt: list[int], got: list[int], want: list[int]
) -> None:
    if got == want:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:j]])).logits[0, -1].float()
    gap = (logits[want[j]] - logits[got[j]]).abs().item()
    assert gap <= TIE, f"step {j}: tandem {got[j]} vs transformers {want[j]} (gap {gap:.2e})"


@pytest.fixture(scope="module")
def expected(reference: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [_hf_greedy(reference, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_greedy_tokens_equal_transformers(
    smollm2_gguf: Path,
    reference: torch.nn.Module,
    prompts: list[list[int]],
    expected: list[list[int]],
    overlap: bool,
) -> None:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(
        model_path=str(smollm2_gguf),
        device="cpu",
        dtype="float32",
        chunked_prefill_size=16,
        disable_overlap_schedule=not overlap,
    ) as engine:
        cold = engine.generate(input_ids=prompts, sampling_params=params)
        # Again: now every prompt's prefix (and the shared system turn) is cached.
        warm = engine.generate(input_ids=prompts, sampling_params=params)
        idle_clean(engine)
    for prompt, want, first, second in zip(prompts, expected, cold, warm, strict=True):
        _assert_same_or_tie(reference, prompt, first["output_ids"], want)
        assert second["output_ids"] == first["output_ids"]
        assert second["meta_info"]["cached_tokens"] > 0


# The dequantized engine sums the same float32 values as transformers in another order;
# the quantized one (its default) multiplies its int8 dot products by x in two 8-bit
# parts (kernels/cpu_quant.cpp, with AVX512-VNNI), a relative error of 1 / 65,000 per
# input, which thirty layers take to a few thousandths of a logprob.
PROMPT_LOGPROB_TOLERANCE = {"none": 2e-3, "gguf": 5e-3}


@pytest.mark.parametrize("quantization", sorted(PROMPT_LOGPROB_TOLERANCE))
def test_prompt_logprobs_equal_transformers(
    smollm2_gguf: Path, reference: torch.nn.Module, prompts: list[list[int]], quantization: str
) -> None:
    prompt = prompts[0]
    with Engine(
        model_path=str(smollm2_gguf), device="cpu", dtype="float32", chunked_prefill_size=16,
        quantization=quantization,
    ) as engine:  # fmt: skip
        out = engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
        idle_clean(engine)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    assert got[0] is None
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])
    atol = PROMPT_LOGPROB_TOLERANCE[quantization]
    torch.testing.assert_close(torch.tensor(got[1:]), want[:, 0], rtol=0, atol=atol)


def test_chat_answers_the_capital_of_france(smollm2_gguf: Path) -> None:
    with Engine(model_path=str(smollm2_gguf), device="cpu") as engine:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = engine.generate(text, {"max_new_tokens": 32, "temperature": 0})
    assert "Paris" in out["text"]
    # It ends its turn with <|im_end|>, which stops generation and is not shown.
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "<|im_end|>" not in out["text"]
