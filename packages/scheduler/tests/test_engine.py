"""The offline Engine on the normal loop against transformers, the reference no one
here wrote: greedy tokens, logits at every step, chunked prefill, sampling, stops,
logprobs, bad input, and the accounting invariant."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from reference_models import FAMILIES, VOCAB, load_reference

from tandem.scheduler import Engine

PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [7, 8], [300, 1, 64, 64, 64, 12, 9, 200, 31, 77, 18, 4, 6]]


def _engine(path: Path, **options: object) -> Engine:
    opts = {"dtype": "float32", "device": "cpu", "disable_overlap_schedule": True}
    opts.update(options)
    return Engine(model_path=str(path), **opts)  # type: ignore[arg-type]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(  # type: ignore[attr-defined]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        min_new_tokens=n, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _teacher_forced_logits(
    model: torch.nn.Module, prompt: list[int], out: list[int]
) -> torch.Tensor:
    """Reference logits for every generated position: one forward over the prompt and
    the engine's own tokens (so an honest near-tie cannot cascade)."""
    ids = torch.tensor([prompt + out[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 :]


def _assert_greedy_matches(model: torch.nn.Module, prompt: list[int], out: list[int]) -> None:
    expected = _hf_greedy(model, prompt, len(out))
    if out == expected:
        return
    # Only an honest tie may differ: at the first divergence the two tokens' reference
    # logits must be within float noise of each other.
    ref = _teacher_forced_logits(model, prompt, out)
    j = next(i for i, (a, b) in enumerate(zip(out, expected, strict=True)) if a != b)
    margin = (ref[j].max() - ref[j, out[j]]).item()
    assert margin <= 1e-4, f"step {j}: tandem {out[j]} vs transformers {expected[j]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(checkpoints: dict[str, Path], family: str) -> None:
    path = checkpoints[family]
    model = load_reference(path)
    with _engine(path) as engine:
        single = engine.generate(
            input_ids=PROMPTS[0],
            sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        batch = engine.generate(
            input_ids=PROMPTS,
            sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        )
        info = engine.get_server_info()
    assert len(single["output_ids"]) == 12
    _assert_greedy_matches(model, PROMPTS[0], single["output_ids"])
    for prompt, result in zip(PROMPTS, batch, strict=True):
        assert len(result["output_ids"]) == 10
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert result["meta_info"]["prompt_tokens"] == len(prompt)
        _assert_greedy_matches(model, prompt, result["output_ids"])
    assert info["free_rows"] == info["max_running_requests"]
    assert info["available_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_on_prefill_and_every_decode_step(
    checkpoints: dict[str, Path], family: str
) -> None:
    path = checkpoints[family]
    model = load_reference(path)
    with _engine(path) as engine:
        engine.scheduler.record_logits = True
        results = engine.generate(
            input_ids=PROMPTS,
            sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        logs = engine.scheduler.recorded_logits
    for prompt, result in zip(PROMPTS, results, strict=True):
        ours = torch.stack(logs[result["meta_info"]["id"]])
        ref = _teacher_forced_logits(model, prompt, result["output_ids"])
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_equals_unchunked(checkpoints: dict[str, Path], page_size: int) -> None:
    path = checkpoints["llama3"]
    prompt = [
        int(x) for x in torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(3))
    ]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with _engine(path, page_size=page_size, chunked_prefill_size=-1) as whole:
        whole.scheduler.record_logits = True
        a = whole.generate(input_ids=prompt, sampling_params=params)
        logits_a = torch.stack(whole.scheduler.recorded_logits[a["meta_info"]["id"]])
    with _engine(path, page_size=page_size, chunked_prefill_size=7) as chunked:
        chunked.scheduler.record_logits = True
        b = chunked.generate(input_ids=prompt, sampling_params=params)
        logits_b = torch.stack(chunked.scheduler.recorded_logits[b["meta_info"]["id"]])
        steps = chunked.get_server_info()["prefill_steps"]
    assert steps == 7  # ceil(45 / 7)
    assert a["output_ids"] == b["output_ids"]
    assert (logits_a - logits_b).abs().max().item() <= 1e-4


def test_decode_after_prefill_equals_a_full_forward(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen3"]
    prompt = PROMPTS[2]
    with _engine(path) as engine:
        engine.scheduler.record_logits = True
        out = engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        )
        decoded = torch.stack(engine.scheduler.recorded_logits[out["meta_info"]["id"]])
        # prefill the whole sequence at once: its last logits equal the last decode step's
        full = prompt + out["output_ids"][:-1]
        again = engine.generate(
            input_ids=full,
            sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
        )
        prefilled = engine.scheduler.recorded_logits[again["meta_info"]["id"]][0]
    assert (decoded[-1] - prefilled).abs().max().item() <= 1e-4
    assert again["output_ids"] == out["output_ids"][-1:]


def test_seeded_sampling_is_reproducible_across_batch_compositions(
    checkpoints: dict[str, Path],
) -> None:
    path = checkpoints["mistral"]
    seeded = {
        "max_new_tokens": 10,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
        "ignore_eos": True,
    }
    other = {"max_new_tokens": 7, "temperature": 1.3, "ignore_eos": True}
    with _engine(path) as engine:
        alone = engine.generate(input_ids=PROMPTS[1], sampling_params=seeded)
        crowd = engine.generate(
            input_ids=[PROMPTS[0], PROMPTS[1], PROMPTS[2]], sampling_params=[other, seeded, other]
        )
        reordered = engine.generate(
            input_ids=[PROMPTS[1], PROMPTS[2]], sampling_params=[seeded, other]
        )
        different_seed = engine.generate(
            input_ids=PROMPTS[1], sampling_params={**seeded, "seed": 99}
        )
    assert alone["output_ids"] == crowd[1]["output_ids"] == reordered[0]["output_ids"]
    assert alone["output_ids"] != different_seed["output_ids"]


def test_logprobs_equal_the_reference_log_softmax(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen2"]
    model = load_reference(path)
    with _engine(path) as engine:
        out = engine.generate(
            input_ids=PROMPTS[0],
            sampling_params={
                "max_new_tokens": 5,
                "temperature": 0.7,
                "seed": 5,
                "ignore_eos": True,
            },
            return_logprob=True,
            top_logprobs_num=3,
        )
    ref = torch.log_softmax(_teacher_forced_logits(model, PROMPTS[0], out["output_ids"]), -1)
    meta = out["meta_info"]
    for j, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        assert tok == out["output_ids"][j]
        assert lp == pytest.approx(ref[j, tok].item(), abs=1e-4)
        top = meta["output_top_logprobs"][j]
        values, ids = torch.topk(ref[j], 3)
        assert [t for _, t, _ in top] == ids.tolist()
        assert [v for v, _, _ in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_stop_token_ids_and_eos(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    with _engine(path) as engine:
        free = engine.generate(
            input_ids=PROMPTS[0],
            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        stop_at = free["output_ids"][3]
        first = free["output_ids"].index(stop_at)
        stopped = engine.generate(
            input_ids=PROMPTS[0],
            sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_at]},
        )
        zero = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 0})
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert zero["output_ids"] == []
    assert zero["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings_are_trimmed_and_streaming_matches(tmp_path: Path) -> None:
    from tandem.scheduler.models.tiny import default_model_path

    path = default_model_path(tmp_path)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with _engine(path) as engine:
        free = engine.generate("The quick brown fox", params)
        text = free["text"]
        assert len(text) >= 6
        stop = text[3:5]
        cut = engine.generate("The quick brown fox", {**params, "stop": [stop]})
        chunks = list(engine.generate("The quick brown fox", {**params, "stop": stop}, stream=True))
        streamed_full = list(engine.generate("The quick brown fox", params, stream=True))
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert "".join(c["text"] for c in chunks) == cut["text"]
    assert "".join(c["text"] for c in streamed_full) == text
    assert [t for c in streamed_full for t in c["output_ids"]] == free["output_ids"]


def test_async_generate(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with _engine(path) as engine:
        sync = engine.generate(input_ids=PROMPTS, sampling_params=params)

        async def run() -> tuple[list[dict[str, object]], list[int]]:
            results = await engine.async_generate(input_ids=PROMPTS, sampling_params=params)
            stream = await engine.async_generate(
                input_ids=PROMPTS[0], sampling_params=params, stream=True
            )
            ids = [t async for chunk in stream for t in chunk["output_ids"]]
            return results, ids

        results, streamed = asyncio.run(run())
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in sync]
    assert streamed == sync[0]["output_ids"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [5, VOCAB + 3]}, "input_ids"),
        ({"input_ids": [5, -1]}, "input_ids"),
        ({"input_ids": [5], "sampling_params": {"max_new_tokens": 10_000}}, "max_new_tokens"),
        ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [5], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"prompt": "hi"}, "tokenizer"),
        ({"prompt": None}, "input_ids"),
    ],
)
def test_bad_input_names_the_field_and_spares_the_batch(
    checkpoints: dict[str, Path], kwargs: dict[str, object], field: str
) -> None:
    path = checkpoints["llama"]
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with _engine(path) as engine:
        before = engine.generate(input_ids=PROMPTS[1], sampling_params=params)
        with pytest.raises(ValueError, match=field):
            engine.generate(**kwargs)  # type: ignore[arg-type]
        after = engine.generate(input_ids=PROMPTS[1], sampling_params=params)
        info = engine.get_server_info()
    assert before["output_ids"] == after["output_ids"]
    assert info["free_rows"] == info["max_running_requests"]
    assert info["available_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def test_bad_request_in_a_batch_queues_nothing(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    with _engine(path) as engine:
        with pytest.raises(ValueError, match=r"request 1: .*temperature"):
            engine.generate(
                input_ids=[PROMPTS[0], PROMPTS[1]],
                sampling_params=[{"max_new_tokens": 2}, {"temperature": -0.5}],
            )
        assert engine.get_server_info()["forward_steps"] == 0


def test_unknown_engine_option_is_named(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"page_sise.*page_size"):
        _engine(checkpoints["llama"], page_sise=4)


def test_rows_and_pages_come_back_under_pressure(checkpoints: dict[str, Path]) -> None:
    """More requests than rows and a KV pool smaller than their sum: admission waits,
    everything finishes, and every row and page is free at the end."""
    path = checkpoints["qwen3"]
    prompts = [[(7 * i + j) % VOCAB for j in range(3 + i % 9)] for i in range(12)]
    params = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    with _engine(path, max_running_requests=3, max_total_tokens=64, page_size=4) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        info = engine.get_server_info()
    with _engine(path) as roomy:
        ref = roomy.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    assert info["free_rows"] == 3
    assert info["available_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def test_async_streams_share_one_loop(checkpoints: dict[str, Path]) -> None:
    """Several streams read concurrently on one event loop get exactly the tokens of a
    batch call; a loop closed with a stream still open aborts that request and costs
    the engine nothing else."""
    path = checkpoints["llama"]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with _engine(path, disable_overlap_schedule=False) as engine:
        batch = engine.generate(input_ids=PROMPTS, sampling_params=params)

        async def one(prompt: list[int]) -> list[int]:
            stream = await engine.async_generate(
                input_ids=prompt, sampling_params=params, stream=True
            )
            return [t async for chunk in stream for t in chunk["output_ids"]]

        async def all_streams() -> list[list[int]]:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

        assert asyncio.run(all_streams()) == [r["output_ids"] for r in batch]

        async def abandon() -> None:
            long = {**params, "max_new_tokens": 40}
            stream = await engine.async_generate(
                input_ids=PROMPTS[0], sampling_params=long, stream=True
            )
            await anext(stream)  # then the loop closes with the request still running

        asyncio.run(abandon())
        again = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [r["output_ids"] for r in again] == [r["output_ids"] for r in batch]
        info = engine.get_server_info()
        assert info["aborted_requests"] == 1
        assert info["generated_tokens"] < 2 * sum(len(r["output_ids"]) for r in batch) + 40


def test_skip_tokenizer_init_runs_on_ids_alone(tmp_path: Path) -> None:
    """SGLang's ``skip_tokenizer_init``: the same ids as with a tokenizer, no text, and
    clear errors for what needs one (text prompts, stop strings); the eos ids stay."""
    from tandem.scheduler.models.tiny import default_model_path

    path = default_model_path(tmp_path)
    params = {"max_new_tokens": 12, "temperature": 0}
    with _engine(path) as engine:
        ids = engine.tokenizer.encode("Once upon a time")
        full = engine.generate(input_ids=ids, sampling_params=params)
    with _engine(path, skip_tokenizer_init=True) as engine:
        assert engine.tokenizer is None
        bare = engine.generate(input_ids=ids, sampling_params=params)
        streamed = list(engine.generate(input_ids=ids, sampling_params=params, stream=True))
        with pytest.raises(ValueError, match="tokenizer"):
            engine.generate("Once upon a time", params)
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.generate(input_ids=ids, sampling_params={**params, "stop": ["x"]})
    assert bare["output_ids"] == full["output_ids"]
    assert bare["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert bare["text"] == ""
    assert all(c["text"] == "" for c in streamed)
    assert [t for c in streamed for t in c["output_ids"]] == full["output_ids"]


def test_token_times_are_one_per_token_and_shared_by_a_step(checkpoints: dict[str, Path]) -> None:
    """``return_token_times``: the host time of each output token, after the submit,
    non-decreasing, one time per step for every token the step produced; absent
    unless asked for."""
    with _engine(checkpoints["llama"]) as engine:
        params = [{"max_new_tokens": n, "ignore_eos": True} for n in (6, 3)]
        start = time.perf_counter()
        timed = engine.generate(input_ids=PROMPTS[:2], sampling_params=params,
                                return_token_times=True)  # fmt: skip
        plain = engine.generate(input_ids=PROMPTS[0], sampling_params=params[0])
    first, second = (r["meta_info"]["output_token_times"] for r in timed)
    assert [len(first), len(second)] == [6, 3]
    assert start < first[0]
    assert first == sorted(first)
    # Both requests decode in the same steps: their first three tokens share times.
    assert second == first[:3]
    assert "output_token_times" not in plain["meta_info"]
