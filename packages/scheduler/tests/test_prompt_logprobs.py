"""Prompt logprobs (``logprob_start_len``) against transformers' float32 log-softmax, in
both loops: chunked prefill, the radix cache warm (the same prompt, a shared prefix),
mixed chunks, retraction, batches where only some requests ask, top-k, streams and the
outbox; and the radix cache and KV accounting back to idle after each (strict
accounting is on in tests, ``TANDEM_DEBUG_FUTURES=1``)."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import idle_clean
from reference_models import VOCAB, load_reference

from tandem.scheduler import Engine
from tandem.scheduler.engine.delivery import Delta, with_logprob_text
from tandem.scheduler.engine.intake import Intake

TOL = 1e-4  # absolute, on logprobs: float32 both sides, different kernels
GREEDY = {"temperature": 0, "ignore_eos": True}
LOOPS = [pytest.param(False, id="normal"), pytest.param(True, id="overlap")]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _engine(path: Path, overlap: bool, **options: Any) -> Engine:
    return Engine(
        model_path=str(path), dtype="float32", device="cpu",
        disable_overlap_schedule=not overlap, **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> torch.nn.Module:
    return load_reference(checkpoints["llama"])


def _ref_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every prompt position ``[P, V]``: row
    ``p`` is the distribution of token ``p + 1``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(
    meta: dict[str, Any], ref: torch.Tensor, prompt: list[int], start: int, top: int = 0
) -> None:
    """``meta``'s prompt logprobs from ``start`` on equal the reference's."""
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt) - start
    tops = meta["input_top_logprobs"] if top else None
    if top:
        assert len(tops) == len(entries)
    else:
        assert "input_top_logprobs" not in meta
    for j, (lp, tok, text) in enumerate(entries):
        p = start + j
        assert tok == prompt[p]
        assert text is None
        if p == 0:
            assert lp is None
            assert tops is None or tops[j] is None
            continue
        assert lp == pytest.approx(ref[p - 1, tok].item(), abs=TOL), p
        if tops is not None:
            values, ids = torch.topk(ref[p - 1], top)
            assert [t for _, t, _ in tops[j]] == ids.tolist(), p
            assert [v for v, _, _ in tops[j]] == pytest.approx(values.tolist(), abs=TOL)
            assert all(text is None for _, _, text in tops[j])


def _clean(engine: Engine) -> None:
    """Idle: every row free, every page free or cached, nothing locked (strict)."""
    idle_clean(engine)
    info = engine.get_server_info()
    assert info["free_rows"] == info["max_running_requests"]
    assert info["available_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
    radix = engine.scheduler.radix
    if radix is not None:
        assert radix.evictable_pages == radix.cached_pages  # nothing still locked


@pytest.mark.parametrize("overlap", LOOPS)
@pytest.mark.parametrize("chunk", [0, 8, 5], ids=["whole", "chunk8", "chunk5"])
def test_prompt_logprobs_equal_transformers(
    checkpoints: dict[str, Path], reference: torch.nn.Module, overlap: bool, chunk: int
) -> None:
    """Every prompt position, with its top 3, whole or split over several prefill
    chunks (``chunked_prefill_size`` smaller than the prompt)."""
    prompts = [_prompt(1, 29), _prompt(2, 13), _prompt(3, 2)]
    options = {"chunked_prefill_size": chunk} if chunk else {}
    with _engine(checkpoints["llama"], overlap, page_size=4, **options) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 3},
            return_logprob=True, top_logprobs_num=3, logprob_start_len=0,
        )  # fmt: skip
        _clean(engine)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out["meta_info"], _ref_logprobs(reference, prompt), prompt, 0, top=3)
        # The output logprobs are there as before.
        assert len(out["meta_info"]["output_token_logprobs"]) == 3


@pytest.mark.parametrize("overlap", LOOPS)
def test_logprob_start_len_counts_from_that_position(
    checkpoints: dict[str, Path], reference: torch.nn.Module, overlap: bool
) -> None:
    prompt = _prompt(4, 23)
    ref = _ref_logprobs(reference, prompt)
    with _engine(checkpoints["llama"], overlap, chunked_prefill_size=6) as engine:
        for start in (1, 6, 7, 22):
            out = engine.generate(
                input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1},
                return_logprob=True, logprob_start_len=start,
            )  # fmt: skip
            _check(out["meta_info"], ref, prompt, start)
        _clean(engine)


@pytest.mark.parametrize("overlap", LOOPS)
def test_a_warm_radix_cache_is_not_reused_for_positions_to_score(
    checkpoints: dict[str, Path], reference: torch.nn.Module, overlap: bool
) -> None:
    """The same prompt twice, the second time with prompt logprobs: nothing of it is
    served from the cache at ``logprob_start_len`` 0, at most the pages before the
    position before it otherwise; a prompt sharing a cached prefix likewise."""
    prompt = _prompt(5, 30)
    other = prompt[:20] + _prompt(6, 9)
    ref, ref_other = _ref_logprobs(reference, prompt), _ref_logprobs(reference, other)
    params = {**GREEDY, "max_new_tokens": 2}
    with _engine(checkpoints["llama"], overlap, page_size=4, chunked_prefill_size=8) as engine:
        plain = engine.generate(input_ids=prompt, sampling_params=params)
        _clean(engine)
        again = engine.generate(input_ids=prompt, sampling_params=params)
        assert again["meta_info"]["cached_tokens"] == 28  # the cache is warm
        _clean(engine)
        whole = engine.generate(
            input_ids=prompt, sampling_params=params, return_logprob=True, top_logprobs_num=2,
            logprob_start_len=0,
        )  # fmt: skip
        assert whole["meta_info"]["cached_tokens"] == 0
        _check(whole["meta_info"], ref, prompt, 0, top=2)
        assert whole["output_ids"] == plain["output_ids"]
        _clean(engine)
        tail = engine.generate(
            input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=18
        )
        # Position 17's logits score token 18: at most 17 tokens, in whole pages, cached.
        assert tail["meta_info"]["cached_tokens"] == 16
        _check(tail["meta_info"], ref, prompt, 18)
        _clean(engine)
        shared = engine.generate(
            input_ids=[other, other], sampling_params=params, return_logprob=True,
            logprob_start_len=[0, 13], top_logprobs_num=[0, 1],
        )  # fmt: skip
        assert shared[0]["meta_info"]["cached_tokens"] == 0
        assert shared[1]["meta_info"]["cached_tokens"] == 12
        _check(shared[0]["meta_info"], ref_other, other, 0)
        _check(shared[1]["meta_info"], ref_other, other, 13, top=1)
        # Without prompt logprobs the cache serves the whole shared prefix.
        served = engine.generate(input_ids=other, sampling_params=params, return_logprob=True)
        assert served["meta_info"]["cached_tokens"] == 28
        assert "input_token_logprobs" not in served["meta_info"]
        _clean(engine)
        # Emptied, the cache gives every page back: none was lost or double-counted.
        assert engine.flush_cache()
        info = engine.get_server_info()
        assert info["cached_kv_tokens"] == 0
        assert info["available_kv_tokens"] == info["max_total_tokens"]


@pytest.mark.parametrize("overlap", LOOPS)
def test_a_mixed_batch_where_only_some_ask(
    checkpoints: dict[str, Path], reference: torch.nn.Module, overlap: bool
) -> None:
    """Requests with and without prompt logprobs prefilled together, in chunks, with
    decode rows riding along (mixed chunks): each gets exactly what it asked for, and
    every request's tokens are those it gets alone."""
    prompts = [_prompt(10 + i, n) for i, n in enumerate((17, 4, 26, 9, 31, 12))]
    starts = [0, -1, 3, 0, -1, 11]
    want = [True, True, True, False, False, True]
    tops = [2, 0, 0, 4, 0, 1]
    params = {**GREEDY, "max_new_tokens": 6}
    options = {"enable_mixed_chunk": True, "chunked_prefill_size": 10, "page_size": 2}
    with _engine(checkpoints["llama"], overlap, **options) as engine:
        alone = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
        engine.flush_cache()
        outs = engine.generate(
            input_ids=prompts, sampling_params=params, return_logprob=want,
            top_logprobs_num=tops, logprob_start_len=starts,
        )  # fmt: skip
        assert engine.scheduler.counters.mixed_steps > 0
        _clean(engine)
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        assert out["output_ids"] == alone[i]["output_ids"]
        if want[i] and starts[i] >= 0:
            ref = _ref_logprobs(reference, prompts[i])
            _check(meta, ref, prompts[i], starts[i], top=tops[i])
        else:
            assert "input_token_logprobs" not in meta
            assert "input_top_logprobs" not in meta
        assert ("output_token_logprobs" in meta) == want[i]


@pytest.mark.parametrize("overlap", LOOPS)
def test_prompt_logprobs_survive_retraction(
    checkpoints: dict[str, Path], reference: torch.nn.Module, overlap: bool
) -> None:
    """KV pressure retracts requests (mid-prefill ones too) and prefills them again:
    each prompt logprob is still computed once, and right."""
    prompts = [_prompt(20 + i, 12 + 3 * i) for i in range(8)]
    options = {"max_total_tokens": 200, "page_size": 1, "chunked_prefill_size": 16}
    with _engine(checkpoints["llama"], overlap, **options) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24},
            return_logprob=True, top_logprobs_num=1, logprob_start_len=0,
        )  # fmt: skip
        assert engine.scheduler.counters.retracted_requests > 0
        _clean(engine)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out["meta_info"], _ref_logprobs(reference, prompt), prompt, 0, top=1)


def test_max_new_tokens_zero_still_scores_the_prompt(
    checkpoints: dict[str, Path], reference: torch.nn.Module
) -> None:
    prompt = _prompt(30, 15)
    with _engine(checkpoints["llama"], True, chunked_prefill_size=4) as engine:
        out = engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 0},
            return_logprob=True, logprob_start_len=0,
        )  # fmt: skip
        _clean(engine)
    assert out["output_ids"] == []
    assert out["meta_info"]["output_token_logprobs"] == []
    _check(out["meta_info"], _ref_logprobs(reference, prompt), prompt, 0)


def test_streams_and_n_copies_carry_prompt_logprobs(
    checkpoints: dict[str, Path], reference: torch.nn.Module
) -> None:
    prompt = _prompt(31, 19)
    ref = _ref_logprobs(reference, prompt)
    with _engine(checkpoints["llama"], True, chunked_prefill_size=7) as engine:
        chunks = list(
            engine.generate(
                input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 4}, stream=True,
                return_logprob=True, logprob_start_len=2, top_logprobs_num=2,
            )
        )  # fmt: skip
        for chunk in chunks:
            _check(chunk["meta_info"], ref, prompt, 2, top=2)
        copies = engine.generate(
            input_ids=prompt, return_logprob=True, logprob_start_len=0,
            sampling_params={"max_new_tokens": 2, "temperature": 1.0, "seed": 3, "n": 3},
        )  # fmt: skip
        for out in copies:
            _check(out["meta_info"], ref, prompt, 0)
        _clean(engine)


class _Outbox:
    """Records the deltas; ``done`` once ``want`` requests ended."""

    def __init__(self, want: int) -> None:
        self.deltas: list[dict[str, Any]] = []
        self.want = want
        self.done = threading.Event()

    def send(self, deltas: list[dict[str, Any]]) -> None:
        self.deltas.extend(deltas)
        if sum(d.meta.get("finish_reason") is not None for d in self.deltas) >= self.want:
            self.done.set()

    def fail(self, rid: str, error: BaseException) -> None:
        raise AssertionError(f"{rid} failed: {error!r}")


def test_the_outbox_sends_prompt_logprobs_once(
    checkpoints: dict[str, Path], reference: torch.nn.Module
) -> None:
    """The server's path: the first delta carries every prompt logprob, as pairs."""
    prompt = _prompt(32, 21)
    ref = _ref_logprobs(reference, prompt)
    outbox = _Outbox(2)
    with _engine(checkpoints["llama"], True, chunked_prefill_size=6) as engine:
        engine.add_requests(
            [prompt, prompt], [{**GREEDY, "max_new_tokens": 3}] * 2, ["a", "b"], outbox,
            return_logprob=True, top_logprobs_num=[1, 0], logprob_start_len=[0, -1],
        )  # fmt: skip
        assert outbox.done.wait(60)
        _clean(engine)
    mine = [d for d in outbox.deltas if d.rid == "a"]
    assert sum(len(d.ids) for d in mine) == 3
    assert mine[0].input_logprobs is not None
    assert Delta.from_wire(mine[0].wire()) == mine[0]  # the prompt logprobs travel too
    assert all(d.input_logprobs is None for d in mine[1:])
    pairs, tops = mine[0].input_logprobs, mine[0].input_top_logprobs
    meta = {
        "input_token_logprobs": [(lp, tok, None) for lp, tok in pairs],
        "input_top_logprobs": [
            None if step is None else [(lp, tok, None) for lp, tok in step] for step in tops
        ],
    }
    _check(meta, ref, prompt, 0, top=1)
    assert all(d.input_logprobs is None for d in outbox.deltas if d.rid == "b")


def test_bad_logprob_start_len_is_refused(checkpoints: dict[str, Path]) -> None:
    prompt = _prompt(33, 6)
    with _engine(checkpoints["llama"], False) as engine:
        for bad in (6, 100, -2, True, 1.5, "0"):
            with pytest.raises(ValueError, match=r"request 0: logprob_start_len must be -1"):
                engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=bad)
        with pytest.raises(ValueError, match="logprob_start_len has 1 entries for 2 prompts"):
            engine.generate(input_ids=[prompt, prompt], logprob_start_len=[0])
        with pytest.raises(ValueError, match="return_text_in_logprobs needs the model's tokenizer"):
            engine.generate(input_ids=prompt, return_logprob=True, return_text_in_logprobs=True)
        # Without logprobs asked for, a valid start is ignored, as in SGLang.
        out = engine.generate(
            input_ids=prompt, sampling_params={"max_new_tokens": 1}, logprob_start_len=0
        )
        assert "input_token_logprobs" not in out["meta_info"]
        _clean(engine)


def test_with_logprob_text_fills_the_third_element() -> None:
    meta = {
        "input_token_logprobs": [(None, 5, None), (-1.5, 6, None)],
        "input_top_logprobs": [None, [(-0.5, 7, None)]],
        "output_token_logprobs": [(-0.25, 8, None)],
        "output_top_logprobs": [[(-0.25, 8, None), (-2.0, 9, None)]],
    }
    out = with_logprob_text({"text": "", "output_ids": [8], "meta_info": meta}, str)
    got = out["meta_info"]
    assert got["input_token_logprobs"] == [(None, 5, "5"), (-1.5, 6, "6")]
    assert got["input_top_logprobs"] == [None, [(-0.5, 7, "7")]]
    assert got["output_token_logprobs"] == [(-0.25, 8, "8")]
    assert got["output_top_logprobs"] == [[(-0.25, 8, "8"), (-2.0, 9, "9")]]
    assert meta["output_token_logprobs"] == [(-0.25, 8, None)]  # the input is left as it was


def test_intake_refuses_prompt_logprobs_it_cannot_serve() -> None:
    """Speculative decoding and disaggregation refuse prompt logprobs by name (a 400
    behind the server), before anything is queued."""

    class Worker:
        def check_request(self, params: Any, return_logprob: bool) -> None:
            if return_logprob:
                raise ValueError("logprobs are not supported with speculative decoding")

    base: dict[str, Any] = {
        "tokenizer": None, "vocab_size": VOCAB, "context_length": 256,
        "kv_capacity_tokens": 1024, "lookahead": 0, "in_use": lambda rid: False,
    }  # fmt: skip
    ids = [1, 2, 3]
    spec = Intake(spec=Worker(), **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"request 0: prompt logprobs \(logprob_start_len\) are"):
        spec.requests(None, None, ids, True, 0, False, None, False, logprob_start_len=0)
    disagg = Intake(spec=None, disaggregation_mode="prefill", **base)
    with pytest.raises(ValueError, match="not supported with disaggregation_mode='prefill'"):
        disagg.requests(None, None, ids, True, 0, False, None, False, logprob_start_len=1)
    # Unasked (no logprobs), a start is only checked, and the request is as before.
    plain = Intake(spec=None, **base)
    _, reqs = plain.requests(None, None, ids, False, 0, False, None, False, logprob_start_len=2)
    assert reqs[0].logprob_start_len == -1
    assert reqs[0].prefix_limit == 2
    _, reqs = plain.requests(None, None, ids, True, 0, False, None, False, logprob_start_len=2)
    assert reqs[0].logprob_start_len == 2
    assert reqs[0].prefix_limit == 1  # position 1's logits score token 2
