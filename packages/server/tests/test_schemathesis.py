"""A bounded schemathesis run over ``/openapi.json`` against a live ``tandem serve``: no
generated request (valid or not) may get a 5xx, and every 4xx carries OpenAI's error body.

Generation stays fast: the test clamps the generated token budgets and ``n`` to small
values before sending (the schema itself stays truthful about what the API accepts).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server

MAX_TOKENS = 3
MAX_N = 2
TIMEOUT_S = 30
MAX_EXAMPLES = 60
CONFIG = SchemathesisConfig.from_dict({"seed": 5})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("cache")) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(server: LiveServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=CONFIG)


def _small(value: Any, limit: int) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        return limit
    return value


def _clamp(path: str, body: Any) -> None:
    """Keep generation short: small token budgets and ``n`` (bad types are left alone)."""
    if not isinstance(body, dict):
        return
    if path == "/generate":
        params = body.get("sampling_params")
        if isinstance(params, dict):
            params.setdefault("max_new_tokens", MAX_TOKENS)
            params["max_new_tokens"] = _small(params["max_new_tokens"], MAX_TOKENS)
        elif params is None or params == {}:
            body["sampling_params"] = {"max_new_tokens": MAX_TOKENS}
        return
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body:
            body[key] = _small(body[key], MAX_TOKENS)
    if "n" in body:
        body["n"] = _small(body["n"], MAX_N)
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and len(prompt) > MAX_N
        and not all(isinstance(p, int) for p in prompt)
    ):
        body["prompt"] = prompt[:MAX_N]


def _check_error_body(response: Any) -> None:
    if not 400 <= response.status_code < 500:
        return
    payload = response.json()
    assert isinstance(payload, dict), payload
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert isinstance(error, dict), payload
    assert set(error) == {"message", "type", "param", "code"}, payload
    assert isinstance(error["message"], str), payload
    assert error["message"], payload
    assert isinstance(error["type"], str), payload


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(
    api_schema: schemathesis.BaseSchema, server: LiveServer, mode: GenerationMode
) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 7
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            if case.method.upper() == "POST":
                _clamp(case.path, case.body)
            response = case.call(base_url=server.url, timeout=TIMEOUT_S)
            case.validate_response(response, checks=[not_a_server_error])
            _check_error_body(response)

        run()


def test_every_route_is_described(api_schema: schemathesis.BaseSchema) -> None:
    raw = api_schema.raw_schema
    operations = {(m.upper(), p) for p, item in raw["paths"].items() for m in item}
    assert {
        ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/get_server_info"),
        ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
        ("POST", "/generate"),
    } <= operations  # fmt: skip
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["properties"], path


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "top_k": 2**70}, "top_k"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "seed": -(2**64)}, "seed"),
        ("/v1/completions", {"prompt": [1], "max_tokens": 1, "n": 2, "seed": 2**63 - 1}, "seed"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 2**64}}, "top_k"),
    ],
)
def test_out_of_int64_is_a_400(server: LiveServer, path: str, body: Any, param: str) -> None:
    """Found by schemathesis: a top_k or seed beyond 64 bits failed in the scheduler (500)."""
    response = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
