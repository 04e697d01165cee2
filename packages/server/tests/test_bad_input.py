"""Hostile and malformed requests: each is a 4xx in OpenAI's shape naming the field, never a
5xx, and preparing a request (parsing, templates, tokenizing) never stalls the event loop.
Most tests drive one live ``tandem serve``; the parsing helpers are also tested in-process."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer

from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server import parsing, prepare, request_models
from tandem.server.errors import APIError, install_handlers

TIMEOUT = 30
WORDS = "Once upon a time there was a little house in the middle of a green forest. "
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def limits(server: LiveServer, cache: Path) -> parsing.Limits:
    info = httpx.get(f"{server.url}/get_server_info", timeout=TIMEOUT).json()
    tokenizer = Tokenizer.from_pretrained(default_model_path(cache))
    return parsing.Limits(
        int(info["vocab_size"]), int(info["context_length"]), prepare.max_token_chars(tokenizer)
    )


def post(server: LiveServer, path: str, body: Any = None, raw: bytes | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=TIMEOUT)


def refused(response: httpx.Response, param: str | None, status: int = 400) -> dict[str, Any]:
    """The error of a refusal in OpenAI's shape, naming ``param``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    return error  # type: ignore[no-any-return]


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


# -- 1. preparation off the event loop ---------------------------------------------------------
def test_health_answers_while_a_big_prompt_is_tokenized(server: LiveServer) -> None:
    """67 prompts of 30,000 characters (2 MB of JSON, under the body limit) take the
    tokenizer most of a second; /health, polled four at a time meanwhile, stays fast.
    Tokenized on the event loop, a poll would wait about as long as the whole request:
    the bound is a third of that (at least 0.1 s), which a loaded 2-core machine's
    scheduling noise stays under (0.13 s seen once under a full parallel test run)."""
    prompts = [(WORDS * 400)[:30_000] for _ in range(67)]
    elapsed = 0.0

    async def main() -> tuple[httpx.Response, list[float]]:
        nonlocal elapsed
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:

            async def health() -> float:
                start = time.perf_counter()
                response = await client.get("/health")
                assert response.status_code == 200
                return time.perf_counter() - start

            await asyncio.gather(*(health() for _ in range(4)))  # open the connections
            start = time.perf_counter()
            big = asyncio.create_task(
                client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1})
            )
            latencies: list[float] = []
            while not big.done():
                latencies += await asyncio.gather(*(health() for _ in range(4)))
                await asyncio.sleep(0.02)
            response = await big
            elapsed = time.perf_counter() - start
            return response, latencies

    response, latencies = asyncio.run(asyncio.wait_for(main(), 60))
    # The prompts were tokenized: each is too long for the context in tokens, not characters.
    error = refused(response, "prompt[0]")
    assert error["code"] == "context_length_exceeded"
    assert "tokens" in error["message"]
    assert len(latencies) >= 8, latencies
    assert max(latencies) < max(0.1, elapsed / 3), (elapsed, sorted(latencies)[-5:])


# -- 2. the character-length precheck ----------------------------------------------------------
def test_longest_token_text_of_the_default_model(limits: parsing.Limits) -> None:
    # <|begin_of_text|>, the longest special token, is 17 characters.
    assert limits.max_token_chars == 17


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "LONG"}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", "LONG"]}, "prompt[1]"),
        ("/generate", {"text": "LONG"}, "text"),
        (CHAT, {"messages": user("LONG")}, "messages"),
    ],
)
def test_a_text_too_long_to_fit_is_refused_before_tokenizing(
    server: LiveServer, limits: parsing.Limits, path: str, body: dict[str, Any], param: str
) -> None:
    text = "x" * (limits.max_text_chars + 1)
    filled = json.loads(json.dumps(body).replace("LONG", text))
    start = time.perf_counter()
    error = refused(post(server, path, filled), param)
    assert error["code"] == "context_length_exceeded"
    assert "characters" in error["message"], error  # the precheck's message, not the tokens'
    assert time.perf_counter() - start < 5


def test_the_precheck_never_tokenizes() -> None:
    limits = parsing.Limits(vocab_size=100, context_length=10, max_token_chars=4)
    assert limits.max_text_chars == 36
    parsing.check_text_length("x" * 36, limits, "prompt")
    with pytest.raises(APIError) as info:
        parsing.check_text_length("x" * 37, limits, "prompt")
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    parsing.check_text_length("x" * 10**6, parsing.Limits(100, 10), "prompt")  # bound unknown


def test_a_long_id_list_is_refused_by_its_length_first(server: LiveServer) -> None:
    limits = parsing.Limits(vocab_size=100, context_length=10)
    with pytest.raises(APIError) as info:
        parsing.check_ids([10**9] * 11, limits, "prompt")  # bad ids, but too many first
    assert info.value.code == "context_length_exceeded"
    error = refused(post(server, "/v1/completions", {"prompt": [1] * 500_000}), "prompt")
    assert error["code"] == "context_length_exceeded"


# -- 3. the raw body ----------------------------------------------------------------------------
def test_json_nested_1000_deep_is_refused(server: LiveServer) -> None:
    deep = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    for path in ("/v1/completions", CHAT, "/generate"):
        error = refused(post(server, path, raw=deep), None)
        assert f"depth limit is {parsing.MAX_JSON_DEPTH}" in error["message"]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"prompt": "caf\xe9"}', "UTF-8"),
        (b'{"prompt": "hi"', "not valid JSON"),
        (b'{"prompt": "hi", "temperature": NaN}', "NaN"),
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
    ],
)
def test_bodies_that_are_not_json_objects(server: LiveServer, raw: bytes, words: str) -> None:
    assert words in refused(post(server, "/v1/completions", raw=raw), None)["message"]


def test_depth_scan() -> None:
    assert not parsing.too_deep(b"[" * 64 + b"]" * 64, 64)
    assert parsing.too_deep(b"[" * 65 + b"]" * 65, 64)
    assert parsing.too_deep(b'{"a":' * 65 + b"1" + b"}" * 65, 64)
    # Brackets in strings, escaped quotes included, do not nest.
    inside = b'["' + b"[" * 100 + b'\\"' + b"{" * 100 + b'"]'
    assert not parsing.too_deep(inside, 64)
    assert parsing.load_json(inside)[0].startswith("[[")
    # Linear time, even for an unterminated string full of escaped quotes.
    start = time.perf_counter()
    parsing.too_deep(b'["' + b'\\"' * 10**6 + b"[" * 100, 64)
    assert time.perf_counter() - start < 2


# -- 4. lone surrogates -------------------------------------------------------------------------
SURROGATE = "\udc80x"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", SURROGATE]}, "prompt[1]"),
        ("/v1/completions", {"prompt": "hi", "stop": SURROGATE}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", SURROGATE]}, "stop[1]"),
        ("/v1/completions", {"prompt": "hi", "model": SURROGATE}, "model"),
        ("/v1/completions", {"prompt": "hi", "user": SURROGATE}, "user"),
        (CHAT, {"messages": user(SURROGATE)}, "messages[0].content"),
        (CHAT, {"messages": [{"role": SURROGATE, "content": "hi"}]}, "messages[0].role"),
        (
            CHAT,
            {"messages": user([{"type": "text", "text": SURROGATE}])},
            "messages[0].content[0].text",
        ),
        (CHAT, {"messages": user("hi"), "stop": [SURROGATE]}, "stop[0]"),
        ("/generate", {"text": SURROGATE}, "text"),
        ("/generate", {"text": "hi", "rid": SURROGATE}, "rid"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"stop": SURROGATE}},
            "sampling_params.stop",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"\udc80": 1}}, "sampling_params.\\udc80"),
    ],
)
def test_lone_surrogates_are_refused(
    server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    # json.dumps writes them as "\udc80" escapes, which json.loads turns back into one.
    assert "\\udc80" in json.dumps(body)
    refused(post(server, path, body), param)


def test_surrogate_path() -> None:
    assert parsing.surrogate_path({"a": [1, "ok", {"b": "\ud800"}]}) == "a[2].b"
    # An escaped pair is one character once parsed; unpaired halves are not text.
    assert parsing.surrogate_path(json.loads('{"a": "\\ud83d\\ude00"}')) is None
    assert parsing.surrogate_path({"a": "\ud83d\ude00"}) == "a"
    assert parsing.surrogate_path(["x", "\udfff"]) == "[1]"
    nested: Any = "\udc80"
    for _ in range(5000):  # deeper than Python's recursion limit: no RecursionError
        nested = [nested]
    assert parsing.surrogate_path(nested) == "[0]" * 5000


# -- 5. integers out of range -------------------------------------------------------------------
BIG = 2**64


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"input_ids": [1, 2], "top_logprobs_num": BIG}, "top_logprobs_num"),
        ("/generate", {"input_ids": [1, 2], "top_logprobs_num": 21}, "top_logprobs_num"),
        ("/generate", {"input_ids": [1, BIG]}, "input_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": BIG}}, "sampling_params.top_k"),
        ("/generate", {"text": "hi", "sampling_params": {"seed": BIG}}, "sampling_params.seed"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": BIG}},
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"stop_token_ids": [BIG]}},
            "sampling_params.stop_token_ids",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"temperature": 10**400}},
            "sampling_params.temperature",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": BIG}, "max_tokens"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_completion_tokens": -BIG},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"prompt": "hi", "n": BIG}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": BIG}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "top_k": BIG}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "seed": BIG}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": -BIG}, "seed"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [BIG]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "temperature": 10**400}, "temperature"),
        ("/v1/completions", {"prompt": [[1, BIG]]}, "prompt[0]"),
        (CHAT, {"messages": user("hi"), "logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
        (CHAT, {"messages": user("hi"), "n": 0}, "n"),
    ],
)
def test_integers_out_of_range(
    server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    refused(post(server, path, body), param)


def test_top_logprobs_num_up_to_20_works(server: LiveServer) -> None:
    body = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 20}
    body["sampling_params"] = {"max_new_tokens": 1}
    out = post(server, "/generate", body)
    assert out.status_code == 200, out.text
    assert len(out.json()["meta_info"]["output_top_logprobs"][0]) == 20


# -- 6. null content ----------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["user", "system", "assistant", "tool"])
def test_null_content_is_refused(server: LiveServer, role: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None}]
    error = refused(post(server, CHAT, {"messages": messages}), "messages[1].content")
    assert "messages[1].content" in error["message"]
    missing = [{"role": "user", "content": "hi"}, {"role": role}]
    refused(post(server, CHAT, {"messages": missing}), "messages[1].content")


# -- 7. fan-out ---------------------------------------------------------------------------------
def test_too_many_choices_are_refused(server: LiveServer) -> None:
    body = {"prompt": ["hello"] * 200, "n": 128, "max_tokens": 1}
    error = refused(post(server, "/v1/completions", body), "n")
    assert "max_choices" in error["message"]
    assert "25600" in error["message"]  # what the request asked for
    body = {"prompt": [[1, 2]] * 300, "max_tokens": 1}
    assert "max_choices" in refused(post(server, "/v1/completions", body), "prompt")["message"]


# -- 8. a 500 tells nothing but an id -----------------------------------------------------------
def test_unexpected_errors_hide_their_text(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    install_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret detail: the password is hunter2")

    with caplog.at_level(logging.ERROR, logger="tandem.server"):
        response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    assert "secret" not in response.text
    error_id = response.headers["X-Request-Id"]
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert error_id in error["message"]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged
    assert logged[0].exc_info is not None
    assert "secret detail" in str(logged[0].exc_info[1])


# -- 9. 405 carries Allow -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", "/v1/completions", "POST"),
        ("GET", CHAT, "POST"),
        ("PUT", "/generate", "POST"),
        ("POST", "/health", "GET"),
        ("DELETE", "/v1/models", "GET"),
    ],
)
def test_405_lists_the_allowed_methods(
    server: LiveServer, method: str, path: str, allow: str
) -> None:
    # (A POST without a JSON content type is a 415 at the front door, before routing.)
    headers = {"Content-Type": "application/json"}
    response = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=TIMEOUT)
    refused(response, None, 405)
    assert response.headers["Allow"] == allow


def test_405_allow_lists_every_route_of_a_path() -> None:
    app = FastAPI()
    install_handlers(app)
    app.get("/thing")(lambda: None)
    app.put("/thing")(lambda: None)
    response = TestClient(app).delete("/thing")
    assert response.status_code == 405
    assert response.headers["Allow"] == "GET, PUT"


# -- 10. the OpenAPI document -------------------------------------------------------------------
def test_openapi_documents_answers_and_bounds(server: LiveServer, limits: parsing.Limits) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT).json()
    paths = doc["paths"]
    health = paths["/health"]["get"]["responses"]
    ok = health["200"]["content"]["application/json"]["schema"]
    assert ok["properties"]["status"] == {"const": "ok"}
    assert "error" in health["503"]["content"]["application/json"]["schema"]["properties"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    for path in ("/v1/completions", CHAT, "/generate"):
        answers = paths[path]["post"]["responses"]
        assert {"200", "400", "401", "405", "413", "415", "503"} <= set(answers), path
        assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "404" in paths["/v1/completions"]["post"]["responses"]
    assert "Allow" in paths["/generate"]["post"]["responses"]["405"]["headers"]
    text = json.dumps(doc)
    assert "x-tandem-bound" not in text
    schema = paths["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    ids = schema["properties"]["input_ids"]["anyOf"][0]
    assert ids["items"]["maximum"] == limits.vocab_size - 1
    assert ids["maxItems"] == limits.context_length - 1
    top = schema["properties"]["top_logprobs_num"]["anyOf"][0]
    assert (top["minimum"], top["maximum"]) == (0, request_models.MAX_TOP_LOGPROBS)
    sampling = schema["properties"]["sampling_params"]["anyOf"][0]
    assert set(sampling["properties"]) == set(request_models.SamplingParams.model_fields)
