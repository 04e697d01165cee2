"""A bounded schemathesis run over ``/openapi.json`` against a live ``tandem serve``, with
every check schemathesis has (``--checks all``: server errors; status codes, content
types, headers and bodies against the schema; valid data accepted, invalid data refused;
undeclared methods answered 405 with ``Allow``...) over all its phases, through its
engine, which is what ``schemathesis run`` drives. Every 4xx must carry OpenAI's body.

Generation stays fast: valid requests get small token budgets, ``n`` and prompts before
they are sent (still valid; the schema itself stays truthful about what the API accepts).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import CHECKS, CheckContext, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events
from schemathesis.hooks import GLOBAL_HOOK_DISPATCHER, HookContext

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server

MAX_TOKENS = 3
MAX_N = 2
MAX_PROMPT_IDS = 8
TIMEOUT_S = 30
MAX_EXAMPLES = 80
CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": 5,
        "workers": 1,
        "checks": {"enabled": True},
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": True},
        },
        "request-timeout": TIMEOUT_S,
    }
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("cache")) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(server: LiveServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=CONFIG)


def _small(value: Any, limit: int) -> Any:
    # JSON integers may arrive as integral floats (2046.0), which the API accepts too.
    if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
        return limit
    return value


def _short_ids(value: Any) -> Any:
    """A token-id list cut to a few ids (a list of strings or lists is left alone)."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return value[:MAX_PROMPT_IDS]
    return value


# Grammars and tools: a random regex or schema the engine cannot compile is a 400 that
# the schema cannot foresee, and a grammar constrains nothing these checks look at.
# test_structured.py covers them.
CONSTRAINTS = ("regex", "ebnf", "json_schema", "structural_tag")
OPENAI_CONSTRAINTS = (*CONSTRAINTS, "response_format", "tools", "tool_choice")


def _json_arguments(messages: Any) -> None:
    """A tool call's ``arguments`` given as text must be a JSON object's, which a schema
    cannot say of a string: generated text becomes ``{}`` (still a valid body)."""
    for message in messages if isinstance(messages, list) else ():
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                function["arguments"] = "{}"


def _clamp(path: str, body: Any) -> None:
    """Keep generation short: small token budgets, ``n``, prompts, no grammar. Only for
    valid bodies, which stay valid (a smaller budget or prompt, or no grammar, cannot make
    one invalid)."""
    if not isinstance(body, dict):
        return
    if path == "/generate":
        params = body.get("sampling_params")
        if isinstance(params, dict):
            for key in CONSTRAINTS:
                params.pop(key, None)
            params.setdefault("max_new_tokens", MAX_TOKENS)
            params["max_new_tokens"] = _small(params["max_new_tokens"], MAX_TOKENS)
        elif params is None:
            body["sampling_params"] = {"max_new_tokens": MAX_TOKENS}
        if "input_ids" in body:
            body["input_ids"] = _short_ids(body["input_ids"])
        start = body.get("logprob_start_len")
        if isinstance(start, int | float) and not isinstance(start, bool) and start > 0:
            body["logprob_start_len"] = 0  # a prompt position of any prompt
        return
    for key in OPENAI_CONSTRAINTS:
        body.pop(key, None)
    _json_arguments(body.get("messages"))
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body:
            body[key] = _small(body[key], MAX_TOKENS)
    if "n" in body:
        body["n"] = _small(body["n"], MAX_N)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = _short_ids(prompt)
        if not all(isinstance(p, int) for p in prompt):
            prompt = [_short_ids(p) for p in prompt[:MAX_N]]
        body["prompt"] = prompt


@pytest.fixture
def clamped() -> Iterator[None]:
    def before_call(context: HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
        meta = case.meta
        if case.method.upper() == "POST" and meta is not None and meta.generation.mode.is_positive:
            _clamp(case.path, case.body)

    schemathesis.hook(before_call)
    try:
        yield
    finally:
        GLOBAL_HOOK_DISPATCHER.unregister(before_call)


@schemathesis.check
def openai_error_body(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """Every 4xx carries OpenAI's error body."""
    if not 400 <= response.status_code < 500:
        return None
    payload = response.json()
    assert isinstance(payload, dict), payload
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert isinstance(error, dict), payload
    assert set(error) == {"message", "type", "param", "code"}, payload
    assert isinstance(error["message"], str), payload
    assert error["message"], payload
    assert isinstance(error["type"], str), payload
    return None


def test_every_check_is_on(api_schema: schemathesis.BaseSchema) -> None:
    load_all_checks()
    operation = next(iter(api_schema.get_all_operations())).ok()
    config = api_schema.config.checks_config_for(operation=operation, phase=None)
    ctx = CheckContext(None, None, None, config, None, response_checks=None)
    functions = {c.__name__ for c in CHECKS.get_all() if not isinstance(c, type)}
    assert functions <= {c.__name__ for c in ctx.internals.checks}
    assert {"positive_data_acceptance", "unsupported_method", "openai_error_body"} <= functions


def test_api_conforms(api_schema: schemathesis.BaseSchema, clamped: None) -> None:
    problems: list[str] = []
    scenarios = 0
    for event in schemathesis.engine.from_schema(api_schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            scenarios += 1
            for case_id, nodes in event.recorder.checks.items():
                for node in nodes:
                    if node.status is Status.SUCCESS:
                        continue
                    case = event.recorder.cases[case_id].value
                    sent = f"{case.method} {case.path} {case.body!r:.600}"
                    info = node.failure_info
                    detail = f"{info.failure.title}: {info.failure.message}" if info else "error"
                    interaction = event.recorder.interactions.get(case_id)
                    answer = interaction.response if interaction is not None else None
                    got = answer.content[:300].decode(errors="replace") if answer else ""
                    problems.append(f"{node.name} on {sent}\n  {detail:.1500}\n  got: {got}")
        elif isinstance(event, events.NonFatalError):
            problems.append(f"error in {event.label}: {event.value!r}")
        elif isinstance(event, events.FatalError):
            problems.append(f"fatal: {event.exception!r}")
    assert scenarios > 0
    unique = list(dict.fromkeys(problems))
    assert not unique, f"{len(unique)} problems:\n" + "\n".join(unique[:15])


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
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"top_k": 2**64}},
            "sampling_params.top_k",
        ),
    ],
)
def test_out_of_int64_is_a_400(server: LiveServer, path: str, body: Any, param: str) -> None:
    """Found by schemathesis: a top_k or seed beyond 64 bits failed in the scheduler (500)."""
    response = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
