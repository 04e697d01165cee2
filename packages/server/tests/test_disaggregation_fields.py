"""Prefill/decode disaggregation on the server's side: SGLang's ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` request fields.

In process, none of it needs an engine that disaggregates: the app runs against a
stand-in scheduler client that records what would reach the scheduler process. Each bad
use of the fields is a 400 naming the field (a partial set, a wrong type or range, more
than one sequence, none at all on a prefill or decode server); good ones reach the
scheduler with the request; the scheduler process hands them to ``add_requests`` as
``Bootstrap`` objects; the OpenAPI schema says the same as the parser; ``--dp-size``
with a disaggregation mode is refused at start.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))

from tandem.scheduler.disagg import Bootstrap
from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server import app as app_module
from tandem.server import cli, protocol, scheduler_process
from tandem.server.server_config import ServerConfig

BOOT = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**64 - 1}
CHAT = "/v1/chat/completions"
ROUTES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
}


class StandIn:
    """``SchedulerClient``'s interface; each job finishes at once with one token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.info: dict[str, Any] = {}
        self.alive = False
        self.finished_listeners: list[Any] = []
        self.sent: list[list[dict[str, Any]]] = []
        self.finish: dict[str, Any] = {"type": "length", "length": 1}
        self.tokens = [42]

    async def start(self) -> None:
        self.info = {
            "vocab_size": self.tokenizer.vocab_size, "context_length": 2048,
            "model_path": "/nowhere", "architecture": "LlamaForCausalLM", "device": "cpu",
            "max_stop_strings": 64, "max_stop_string_length": 1024,
        }  # fmt: skip
        self.alive = True

    async def close(self) -> None:
        self.alive = False

    async def stream(self, jobs: list[dict[str, Any]]) -> AsyncIterator[tuple[int, Delta]]:
        self.sent.append(jobs)
        for position, job in enumerate(jobs):
            steps = [[t] for t in self.tokens] or [[]]  # no token: only the finish
            for i, ids in enumerate(steps):
                finish = self.finish if i == len(steps) - 1 else None
                yield position, Delta(job["rid"], ids, {"finish_reason": finish})


@pytest.fixture(scope="module")
def tokenizer(cache: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path(cache))


@pytest.fixture
def serve(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``serve(mode)``: a test client of an app in that disaggregation mode, and its
    stand-in scheduler client."""
    opened: list[TestClient] = []

    def start(mode: str = "null") -> tuple[TestClient, StandIn]:
        client = StandIn(tokenizer)
        monkeypatch.setattr(app_module, "SchedulerClient", lambda *a, **k: client)
        app = app_module.create_app({"disaggregation_mode": mode}, ServerConfig())
        test_client = TestClient(app, base_url="http://127.0.0.1:30000")
        test_client.__enter__()  # runs the lifespan: the client starts
        opened.append(test_client)
        return test_client, client

    yield start
    for test_client in opened:
        test_client.__exit__(None, None, None)


def refused(response: Any, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    return str(error["message"])


# -- what reaches the scheduler ----------------------------------------------------------------
@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("stream", [False, True])
def test_the_fields_travel_with_the_request(serve: Any, path: str, stream: bool) -> None:
    http, client = serve("prefill")
    response = http.post(path, json={**ROUTES[path], **BOOT, "stream": stream})
    assert response.status_code == 200, response.text
    ((job,),) = client.sent
    assert job["bootstrap"] == {"host": "127.0.0.1", "port": 8998, "room": 2**64 - 1}
    # The room survives the trip to the scheduler process (msgpack's unsigned 64 bits).
    assert protocol.decode(protocol.encode({"jobs": [job]}))["jobs"][0] == job


def test_a_null_mode_server_takes_the_fields_or_none(serve: Any) -> None:
    http, client = serve("null")
    assert http.post("/v1/completions", json=ROUTES["/v1/completions"]).status_code == 200
    nulls = dict.fromkeys(BOOT)  # null is absent
    assert http.post("/generate", json={**ROUTES["/generate"], **nulls}).status_code == 200
    assert http.post(CHAT, json={**ROUTES[CHAT], **BOOT}).status_code == 200
    assert [("bootstrap" in jobs[0]) for jobs in client.sent] == [False, False, True]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_a_prefill_or_decode_server_needs_the_fields(serve: Any, mode: str, path: str) -> None:
    http, client = serve(mode)
    message = refused(http.post(path, json=ROUTES[path]), "bootstrap_host", "--disaggregation-mode")
    assert "bootstrap_port" in message
    assert "bootstrap_room" in message
    assert client.sent == []


@pytest.mark.parametrize(
    ("given", "param"),
    [
        ({"bootstrap_host": "h"}, "bootstrap_port"),
        ({"bootstrap_port": 1, "bootstrap_room": 1}, "bootstrap_host"),
        ({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": None}, "bootstrap_room"),
    ],
)
@pytest.mark.parametrize("path", list(ROUTES))
def test_a_partial_set_names_what_is_missing(
    serve: Any, path: str, given: dict[str, Any], param: str
) -> None:
    http, client = serve("null")
    refused(http.post(path, json={**ROUTES[path], **given}), param, "missing", "together")
    assert client.sent == []


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("bootstrap_host", 5, ("a string",)),
        ("bootstrap_host", "", ("host name",)),
        ("bootstrap_host", "two words", ("host name",)),
        ("bootstrap_host", "h" * 256, ("255",)),
        ("bootstrap_port", 0, ("[1, 65535]",)),
        ("bootstrap_port", 65536, ("[1, 65535]",)),
        ("bootstrap_port", "8998", ("an integer",)),
        ("bootstrap_port", True, ("an integer",)),
        ("bootstrap_room", -1, ("18446744073709551615",)),
        ("bootstrap_room", 2**64, ("18446744073709551615",)),
        ("bootstrap_room", 1.5, ("an integer",)),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_bad_values_are_refused_by_name(
    serve: Any, path: str, field: str, value: Any, words: tuple[str, ...]
) -> None:
    http, client = serve("decode")
    refused(http.post(path, json={**ROUTES[path], **BOOT, field: value}), field, *words)
    assert client.sent == []


def test_integral_numbers_and_the_widest_room_are_taken(serve: Any) -> None:
    http, client = serve("decode")
    body = {**ROUTES["/generate"], **BOOT, "bootstrap_port": 8998.0, "bootstrap_room": 0}
    assert http.post("/generate", json=body).status_code == 200
    assert client.sent[0][0]["bootstrap"] == {"host": "127.0.0.1", "port": 8998, "room": 0}


@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        ("/v1/completions", {"n": 2}, "n", ("n=1",)),
        (CHAT, {"n": 3}, "n", ("n=1",)),
        ("/v1/completions", {"prompt": ["one", "two"]}, "bootstrap_room", ("one room per",)),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, "bootstrap_room", ("one room per",)),
    ],
)
def test_one_sequence_per_room(
    serve: Any, path: str, extra: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    http, client = serve("null")
    refused(http.post(path, json={**ROUTES[path], **BOOT, **extra}), param, *words)
    assert client.sent == []
    # Without the fields the same request is fine.
    assert http.post(path, json={**ROUTES[path], **extra}).status_code == 200


def test_a_batch_of_prompts_takes_lists_as_sglang_does(serve: Any) -> None:
    """smg sends a completion's prompts to both servers with one value per prompt."""
    http, client = serve("decode")
    body = {
        "prompt": ["one", "two", "three"], "max_tokens": 1, "bootstrap_host": ["a", "b", "c"],
        "bootstrap_port": 7000, "bootstrap_room": [3, 2**64 - 1, 0],
    }  # fmt: skip
    assert http.post("/v1/completions", json=body).status_code == 200, client.sent
    sent = [job["bootstrap"] for job in client.sent[0]]
    assert sent == [
        {"host": "a", "port": 7000, "room": 3},
        {"host": "b", "port": 7000, "room": 2**64 - 1},
        {"host": "c", "port": 7000, "room": 0},
    ]
    for change, param, words in (
        ({"bootstrap_room": [3, 2]}, "bootstrap_room", ("2 value(s) for 3 prompt(s)",)),
        ({"bootstrap_room": [3, 4, 3]}, "bootstrap_room[2]", ("repeats",)),
        ({"bootstrap_port": [1, 2, 0]}, "bootstrap_port[2]", ("[1, 65535]",)),
        ({"bootstrap_host": ["a", None, "c"]}, "bootstrap_host[1]", ("null",)),
        ({"bootstrap_host": ["a", "b", 3]}, "bootstrap_host[2]", ("a string",)),
    ):
        refused(http.post("/v1/completions", json={**body, **change}), param, *words)
    # Lists are for a list of prompts: elsewhere a field is one value.
    for path in ("/generate", CHAT):
        listed = {**ROUTES[path], **BOOT, "bootstrap_room": [1]}
        refused(http.post(path, json=listed), "bootstrap_room", "an integer")
    assert len(client.sent) == 1


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
@pytest.mark.parametrize("tokens", [[], [42, 43]])
def test_a_failed_hand_over_is_an_error_not_a_short_answer(
    serve: Any, path: str, tokens: list[int]
) -> None:
    """The engine ends a request whose peer failed with an abort and a message: an
    OpenAI route answers it as an error (in the stream once it has begun)."""
    http, client = serve("decode")
    why = "no KV from the prefill server for room 7 within 3 s"
    client.finish, client.tokens = {"type": "abort", "message": why}, tokens
    body = {**ROUTES[path], **BOOT}
    response = http.post(path, json=body)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert why in error["message"]
    assert error["code"] == "disaggregation_failed"
    streamed = http.post(path, json={**body, "stream": True})
    if not tokens:  # the first event is the failure: no stream begins
        assert streamed.status_code == 503, streamed.text
    else:
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert why in json.loads(events[-2])["error"]["message"]
    # /generate shows the engine's finish reason itself, as SGLang does.
    native = http.post("/generate", json={**ROUTES["/generate"], **BOOT})
    assert native.json()["meta_info"]["finish_reason"] == {"type": "abort", "message": why}


def test_health_generate_on_a_prefill_server_does_not_generate(serve: Any) -> None:
    http, client = serve("prefill")
    assert http.get("/health_generate").json() == {"status": "ok"}
    assert client.sent == []


# -- the schema says what the parser does ------------------------------------------------------
def _request_schema(http: TestClient, path: str) -> dict[str, Any]:
    doc = http.get("/openapi.json").json()
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return schema  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["null", "prefill"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_the_schema_agrees_with_the_parser(serve: Any, mode: str, path: str) -> None:
    http, _ = serve(mode)
    validator = jsonschema_rs.Draft202012Validator(_request_schema(http, path))
    cases = [
        ROUTES[path],
        {**ROUTES[path], **BOOT},
        {**ROUTES[path], **dict.fromkeys(BOOT)},
        {**ROUTES[path], "bootstrap_host": "h"},
        {**ROUTES[path], **BOOT, "bootstrap_room": -1},
        {**ROUTES[path], **BOOT, "bootstrap_room": 2**64},
        {**ROUTES[path], **BOOT, "bootstrap_port": 0},
        {**ROUTES[path], **BOOT, "bootstrap_host": "a b"},
        {**ROUTES[path], **BOOT, "bootstrap_host": "[::1]"},
    ]
    if path != "/generate":
        cases += [{**ROUTES[path], **BOOT, "n": 2}, {**ROUTES[path], "n": 2}]
    if path == "/v1/completions":
        cases += [{**ROUTES[path], **BOOT, "prompt": ["a", "b"]}, {**BOOT, "prompt": [[1, 2]]}]
    for body in cases:
        valid = validator.is_valid(body)
        status = http.post(path, json=body).status_code
        assert status == (200 if valid else 400), (mode, body, status)
    # The widest room, exactly: not as a double (2**64), as FastAPI would write it.
    room = _request_schema(http, path)["properties"]["bootstrap_room"]
    assert (room.get("anyOf") or [room])[0]["maximum"] == 2**64 - 1
    assert validator.is_valid({**ROUTES[path], **BOOT, "bootstrap_room": 2**64 - 1})
    assert not validator.is_valid({**ROUTES[path], **BOOT, "bootstrap_room": 2**64})


# -- the scheduler process ---------------------------------------------------------------------
class Engine:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.error = error

    def add_requests(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error


class Socket:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, data: bytes) -> None:
        self.sent.append(protocol.decode(data))


def _jobs(*boots: dict[str, Any] | None) -> dict[str, Any]:
    jobs = []
    for i, boot in enumerate(boots):
        job: dict[str, Any] = {"rid": f"r{i}", "input_ids": [1, 2], "params": {}}
        if boot is not None:
            job["bootstrap"] = boot
        jobs.append(job)
    return protocol.decode(protocol.encode({"type": protocol.ADD, "jobs": jobs}))


def test_the_scheduler_process_passes_bootstrap_objects() -> None:
    engine, push = Engine(), Socket()
    room = {"host": "10.0.0.2", "port": 9000, "room": 2**64 - 1}
    scheduler_process._add(engine, _jobs(room, None), None, push)  # type: ignore[arg-type]
    (call,) = engine.calls
    assert call["bootstrap"] == [Bootstrap("10.0.0.2", 9000, 2**64 - 1), None]
    assert push.sent == []
    scheduler_process._add(engine, _jobs(None), None, push)  # type: ignore[arg-type]
    assert engine.calls[1]["bootstrap"] == [None]


def test_the_engines_refusal_is_a_bad_request() -> None:
    engine = Engine(ValueError("request 0: a decode server needs bootstrap_room"))
    push = Socket()
    scheduler_process._add(engine, _jobs(None), None, push)  # type: ignore[arg-type]
    (reply,) = push.sent
    assert reply["type"] == protocol.ERROR
    assert reply["invalid"] is True
    assert "bootstrap_room" in reply["message"]


# -- startup -----------------------------------------------------------------------------------
def test_data_parallel_disaggregation_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="dp_size=2 cannot be combined"):
        app_module.create_app({"disaggregation_mode": "prefill"}, ServerConfig(dp_size=2))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--dp-size", "2", "--disaggregation-mode", "decode", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --dp-size" in err
    assert "disaggregation_mode=decode" in err


def test_the_mode_and_backend_flags_have_choices(capsys: pytest.CaptureFixture[str]) -> None:
    for flag, choices in (
        ("--disaggregation-mode", "'null', 'prefill', 'decode'"),
        ("--disaggregation-transfer-backend", "'mooncake', 'torch'"),
    ):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", flag, "both"])
        err = capsys.readouterr().err
        assert f"argument {flag}" in err
        assert choices in err
