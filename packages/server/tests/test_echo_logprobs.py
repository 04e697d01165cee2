"""Prompt logprobs through the HTTP API, against transformers' float32 log-softmax on the
tiny model: ``/generate``'s ``logprob_start_len`` (SGLang's ``input_token_logprobs``),
``/v1/completions``' ``echo`` with ``logprobs`` in OpenAI's legacy shape as vLLM returns
it (what lm-evaluation-harness's ``local-completions`` loglikelihood reads), streaming
with echo, and the 4xx answers for bad values. One live ``tandem serve``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server

from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.tokenizer import Tokenizer

TIMEOUT = 60
TOL = 1e-4  # absolute, on logprobs
TEXT = "The quick brown fox jumps over the lazy dog."
CONTEXT = "Once upon a time there was a little house"
CONTINUATION = " in the middle of a green forest"


@pytest.fixture(scope="module")
def model_path(cache: Path) -> Path:
    return default_model_path(cache)


@pytest.fixture(scope="module")
def server(cache: Path, model_path: Path) -> Iterator[LiveServer]:
    with live_server(cache, "--model-path", str(model_path), "--chunked-prefill-size", "8") as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """``[P, V]``: row ``p`` is the distribution of token ``p + 1``."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]  # type: ignore[no-any-return]


def _check_top(entries: list[Any], row: torch.Tensor) -> None:
    """Top alternatives: the reference's top values, each the reference's logprob of its
    token (the tiny model's near-uniform logits may order near-ties differently)."""
    values = torch.topk(row, len(entries)).values.tolist()
    assert [e[0] for e in entries] == pytest.approx(values, abs=TOL)
    for lp, tok, *_ in entries:
        assert lp == pytest.approx(row[tok].item(), abs=TOL)


# -- /generate ---------------------------------------------------------------------------------
def test_generate_returns_sglangs_input_token_logprobs(
    server: LiveServer, tokenizer: Tokenizer, reference: Any
) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 8  # several prefill chunks
    out = ok(
        post(
            server, "/generate",
            {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
             "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0},
        )
    )  # fmt: skip
    meta = out["meta_info"]
    ref = reference(ids)
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(entries) == len(tops) == len(ids)
    assert entries[0] == [None, ids[0], None]
    assert tops[0] is None
    for p in range(1, len(ids)):
        lp, tok, text = entries[p]
        assert tok == ids[p]
        assert text is None
        assert lp == pytest.approx(ref[p - 1, tok].item(), abs=TOL)
        assert len(tops[p]) == 2
        assert all(e[2] is None for e in tops[p])
        _check_top(tops[p], ref[p - 1])
    # The output's entries have SGLang's shape too: [logprob, token_id, text or null].
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])
    assert all(len(step) == 2 for step in meta["output_top_logprobs"])
    assert meta["cached_tokens"] == 0


def test_generate_from_a_later_position_with_text(
    server: LiveServer, tokenizer: Tokenizer, reference: Any
) -> None:
    ids = tokenizer.encode(TEXT)
    out = ok(
        post(
            server, "/generate",
            {"text": TEXT, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
             "return_logprob": True, "logprob_start_len": 5, "return_text_in_logprobs": True},
        )
    )  # fmt: skip
    meta = out["meta_info"]
    ref = reference(ids)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[5:]
    for p, (lp, tok, text) in enumerate(entries, start=5):
        assert lp == pytest.approx(ref[p - 1, tok].item(), abs=TOL)
        assert text == tokenizer.decode([tok], skip_special_tokens=False)
    assert meta["input_top_logprobs"] == []  # no top_logprobs_num
    for _, tok, text in meta["output_token_logprobs"]:
        assert text == tokenizer.decode([tok], skip_special_tokens=False)
    # Without logprob_start_len, none: SGLang's default -1.
    plain = ok(post(server, "/generate", {"input_ids": ids, "return_logprob": True}))
    assert "input_token_logprobs" not in plain["meta_info"]


def test_generate_streams_the_prompt_logprobs_from_the_first_chunk(
    server: LiveServer, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(TEXT)
    body = {
        "input_ids": ids, "stream": True, "return_logprob": True, "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    }  # fmt: skip
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert len(chunks) == 3
    for chunk in chunks:
        assert [e[1] for e in chunk["meta_info"]["input_token_logprobs"]] == ids[1:]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprob_start_len": 4}, "logprob_start_len"),  # the prompt has 4 tokens
        ({"logprob_start_len": 100}, "logprob_start_len"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"logprob_start_len": "0"}, "logprob_start_len"),
        ({"logprob_start_len": True}, "logprob_start_len"),
        ({"logprob_start_len": 1.5}, "logprob_start_len"),
        ({"return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
    ],
)
def test_generate_refuses_bad_values(server: LiveServer, body: dict[str, Any], param: str) -> None:
    full = {"input_ids": [5, 6, 7, 8], "return_logprob": True, **body}
    message = refused(post(server, "/generate", full), param)
    assert param in message


# -- /v1/completions with echo -------------------------------------------------------------------
def _prompt_logprobs_match(
    logprobs: dict[str, Any], ids: list[int], ref: torch.Tensor, tokenizer: Tokenizer, top: int
) -> None:
    """The first ``len(ids)`` entries of an echoed choice's logprobs are the prompt's."""
    n = len(ids)
    assert logprobs["tokens"][:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    for p in range(1, n):
        assert logprobs["token_logprobs"][p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=TOL)
        alternatives = logprobs["top_logprobs"][p]
        assert len(alternatives) <= top  # fewer when two tokens share a text
        best = torch.topk(ref[p - 1], 1).values.item()
        assert max(alternatives.values()) == pytest.approx(best, abs=TOL)


def test_echo_with_logprobs_returns_the_prompt_then_the_completion(
    server: LiveServer, tokenizer: Tokenizer, reference: Any
) -> None:
    ids = tokenizer.encode(TEXT)
    base = {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = ok(post(server, "/v1/completions", {**base, "logprobs": 2}))["choices"][0]
    out = ok(post(server, "/v1/completions", {**base, "logprobs": 2, "echo": True}))
    choice = out["choices"][0]
    assert choice["text"] == TEXT + plain["text"]
    logprobs = choice["logprobs"]
    n = len(ids)
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n + 3
    assert len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == n + 3
    _prompt_logprobs_match(logprobs, ids, reference(ids), tokenizer, 2)
    # The completion's part is what the request without echo returns.
    assert logprobs["tokens"][n:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    # Offsets count each token's text from 0, over the prompt's tokens and then the rest.
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(n + 3)]
    assert plain["logprobs"]["text_offset"][0] == 0
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}


def test_echo_without_logprobs_is_text_only(server: LiveServer) -> None:
    base = {"prompt": TEXT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    plain = ok(post(server, "/v1/completions", base))["choices"][0]
    choice = ok(post(server, "/v1/completions", {**base, "echo": True}))["choices"][0]
    assert choice["text"] == TEXT + plain["text"]
    assert choice["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_requests(
    server: LiveServer, tokenizer: Tokenizer, reference: Any, max_tokens: int
) -> None:
    """lm-evaluation-harness's ``local-completions`` loglikelihood: token-id prompts
    (context + continuation, several per request), ``echo``, ``logprobs: 1``,
    ``max_tokens`` 1 (and 0, as vLLM takes it); it sums ``token_logprobs[ctxlen:-1]``
    and calls the continuation greedy when each equals its step's best alternative."""
    contexts = [tokenizer.encode(CONTEXT), tokenizer.encode(TEXT)]
    continuations = [tokenizer.encode(CONTINUATION, add_special_tokens=False)] * 2
    prompts = [c + k for c, k in zip(contexts, continuations, strict=True)]
    body = {
        "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "echo": True, "seed": 1234,
    }  # fmt: skip
    out = ok(post(server, "/v1/completions", body))
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, prompt, context in zip(choices, prompts, contexts, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        ref = reference(prompt)
        _prompt_logprobs_match(logprobs, prompt, ref, tokenizer, 1)
        # What lm-eval computes, with the slice it uses for max_tokens 1.
        end = len(prompt) if max_tokens == 1 else len(prompt) - 1
        got = logprobs["token_logprobs"][len(context) : end]
        tops = logprobs["top_logprobs"][len(context) : end]
        want = sum(ref[p - 1, prompt[p]].item() for p in range(len(context), end))
        assert sum(got) == pytest.approx(want, abs=1e-3)
        greedy = all(lp == max(top.values()) for lp, top in zip(got, tops, strict=True))
        ref_greedy = all(
            ref[p - 1, prompt[p]].item() >= ref[p - 1].max().item() - 1e-6
            for p in range(len(context), end)
        )
        assert greedy == ref_greedy
        text = tokenizer.decode(prompt)
        assert choice["text"].startswith(text)
        if max_tokens == 0:
            assert choice["text"] == text
            assert choice["finish_reason"] == "length"


def test_echo_streams_the_prompt_in_the_first_chunk(
    server: LiveServer, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(TEXT)
    base = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = ok(post(server, "/v1/completions", {**base, "echo": True}))["choices"][0]
    body = {**base, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    choices = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert choices[0]["text"].startswith(TEXT)
    assert "".join(c["text"] for c in choices) == whole["text"]
    first = choices[0]["logprobs"]
    assert first["tokens"][: len(ids)] == whole["logprobs"]["tokens"][: len(ids)]
    assert first["token_logprobs"][0] is None
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    # Each chunk's offsets continue from the text the chunks before it held.
    seen = 0
    for c in choices:
        if c["logprobs"] and c["logprobs"]["text_offset"]:
            assert c["logprobs"]["text_offset"][0] == seen
        seen += len(c["text"])


def test_the_openai_client_reads_echoed_logprobs(server: LiveServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt=TEXT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = out.choices[0]
    assert choice.text.startswith(TEXT)
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs is not None
    assert choice.logprobs.top_logprobs[0] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": "yes"}, "echo"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": -1}, "logprobs"),
    ],
)
def test_completions_refuse_bad_values(
    server: LiveServer, body: dict[str, Any], param: str
) -> None:
    refused(post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1, **body}), param)
