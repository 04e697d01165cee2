"""The front door: Host allow-list, CORS, draining, the API key, the content type and the
body limit. Most tests drive a small app in-process; a real uvicorn on a thread checks
what only a socket shows (a big upload stopped early, SSE unbuffered), and one live
``tandem serve --api-key`` checks it with the ``openai`` client."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

sys.path.insert(0, str(Path(__file__).parent))
from server_process import call_asgi, free_port, live_server

from tandem.server.errors import install_handlers
from tandem.server.front_door import authenticated, host_name, install_front_door, public_info
from tandem.server.lifecycle import Lifecycle
from tandem.server.server_config import ServerConfig

KEY = "sk-front-door-test"
LIMIT = 1024
INFO = {
    "model_path": "/srv/models/qwen",
    "tokenizer_path": "relative/tok",
    "speculative_draft_model_path": None,
    "cache_dir": "/home/someone/.cache/tandem",
    "windows_dir": "C:\\models\\qwen",
    "scheduler_pid": 4242,
    "device": "cpu",
    "vocab_size": 1000,
    "scheduler_alive": True,
}


def small_app(config: ServerConfig, lifecycle: Lifecycle | None = None) -> FastAPI:
    """Routes shaped like tandem's, behind the real front door. ``app.state.received``
    counts the body bytes the routes were handed."""
    app = FastAPI()
    install_handlers(app)
    install_front_door(app, config, lifecycle or Lifecycle())
    app.state.received = 0
    app.state.release = threading.Event()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse("tandem_up 1\n")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": []}

    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        return INFO if authenticated(request) else public_info(INFO)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        async for chunk in request.stream():
            app.state.received += len(chunk)
        return {"received": app.state.received}

    @app.get("/stream")
    async def stream() -> Response:
        async def events() -> AsyncIterator[str]:
            yield "data: first\n\n"
            # Waits for the client to have read the first event: a buffering
            # middleware would hold that event back, and this would time out.
            ok = await asyncio.to_thread(app.state.release.wait, 10)
            yield f"data: {'second' if ok else 'timeout'}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return call_asgi(app, method, path, **kwargs)


def post(app: FastAPI, path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return call(app, "POST", path, headers=headers, **kwargs)


def assert_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"]
    assert response.headers["connection"] == "close"
    return dict(error)


# -- Host --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.0.0.1:30000", "localhost", "LOCALHOST:8080", "[::1]:30000", "[::1]"],
)
def test_loopback_names_are_accepted(host: str) -> None:
    response = call(small_app(ServerConfig()), "GET", "/v1/models", headers={"Host": host})
    assert response.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:30000", "127.0.0.1.evil.example"])
def test_other_hosts_are_refused_on_loopback(host: str) -> None:
    response = call(small_app(ServerConfig()), "GET", "/v1/models", headers={"Host": host})
    error = assert_error(response, 400, "Host header", host)
    assert error["type"] == "invalid_request_error"


def test_host_allow_list_flags() -> None:
    named = ServerConfig(allowed_hosts=("api.example",))
    assert call(small_app(named), "GET", "/health", headers={"Host": "api.example:443"}).is_success
    refused = call(small_app(named), "GET", "/health", headers={"Host": "localhost"})
    assert refused.status_code == 400
    wildcard = ServerConfig(allowed_hosts=("*",))
    assert call(small_app(wildcard), "GET", "/health", headers={"Host": "x.example"}).is_success
    public = ServerConfig(host="0.0.0.0")  # not loopback: any Host
    assert call(small_app(public), "GET", "/health", headers={"Host": "x.example"}).is_success


def test_host_name() -> None:
    assert host_name("[::1]:30000") == "::1"
    assert host_name("::1") == "::1"
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1") == "[::1"


# -- CORS --------------------------------------------------------------------------------------
ORIGIN = "http://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_no_cors_headers_by_default() -> None:
    app = small_app(ServerConfig())
    response = call(app, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("access-control-")]
    preflight = call(app, "OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("allowed", [ORIGIN, "*"])
def test_cors_for_an_allowed_origin(allowed: str) -> None:
    app = small_app(ServerConfig(api_key=KEY, allowed_origins=(allowed,)))
    preflight = call(app, "OPTIONS", "/v1/completions", headers=PREFLIGHT)  # no key
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] in (ORIGIN, "*")
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    auth = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    response = post(app, json={}, headers=auth)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in (ORIGIN, "*")
    # an error the page may read as well
    refused = post(app, json={}, headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] in (ORIGIN, "*")


def test_cors_other_origin_gets_no_allow() -> None:
    app = small_app(ServerConfig(allowed_origins=(ORIGIN,)))
    headers = {**PREFLIGHT, "Origin": "http://evil.example"}
    preflight = call(app, "OPTIONS", "/v1/completions", headers=headers)
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers


# -- draining and a hung scheduler -------------------------------------------------------------
@pytest.mark.parametrize(
    ("lifecycle", "message"),
    [
        (Lifecycle(draining=True), "the server is shutting down"),
        (Lifecycle(hung="no progress for 300 s"), "the scheduler is not responding: no progress"),
    ],
)
def test_not_accepting_is_a_503_but_health_and_metrics(lifecycle: Lifecycle, message: str) -> None:
    app = small_app(ServerConfig(api_key=KEY), lifecycle)
    auth = {"Authorization": f"Bearer {KEY}"}
    error = assert_error(post(app, json={}, headers=auth), 503, message)
    assert error["type"] == "service_unavailable"
    assert_error(call(app, "GET", "/v1/models", headers=auth), 503, message)
    assert app.state.received == 0
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/metrics", headers=auth).status_code == 200
    assert call(app, "POST", "/health").status_code == 503  # only GET passes


# -- API key -----------------------------------------------------------------------------------
def test_api_key() -> None:
    app = small_app(ServerConfig(api_key=KEY))
    missing = call(app, "GET", "/v1/models")
    error = assert_error(missing, 401, "missing API key")
    assert error["code"] == "invalid_api_key"
    assert error["type"] == "invalid_request_error"
    assert missing.headers["www-authenticate"] == "Bearer"
    for wrong in (f"Bearer {KEY}x", "Bearer ", f"Basic {KEY}", KEY, f"Bearer {KEY[:-1]}"):
        response = call(app, "GET", "/v1/models", headers={"Authorization": wrong})
        assert_error(response, 401, "incorrect API key")
    for right in (f"Bearer {KEY}", f"bearer  {KEY}"):
        assert call(app, "GET", "/v1/models", headers={"Authorization": right}).is_success
    assert post(app, json={}).status_code == 401
    assert post(app, json={}, headers={"Authorization": f"Bearer {KEY}"}).is_success
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/metrics").status_code == 401
    assert call(app, "GET", "/openapi.json").status_code == 401


def test_metrics_without_auth() -> None:
    app = small_app(ServerConfig(api_key=KEY, metrics_without_auth=True))
    assert call(app, "GET", "/metrics").status_code == 200
    assert call(app, "GET", "/v1/models").status_code == 401


def test_no_key_configured_lets_everything_in() -> None:
    app = small_app(ServerConfig())
    assert call(app, "GET", "/v1/models").status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200


def test_server_info_hides_paths_and_pids_unless_authenticated() -> None:
    public = {"tokenizer_path", "speculative_draft_model_path", "cache_dir", "windows_dir"}
    public |= {"model_path", "scheduler_pid"}
    expected = {k: v for k, v in INFO.items() if k not in public}
    assert public_info(INFO) == expected
    keyless = small_app(ServerConfig())
    assert call(keyless, "GET", "/get_server_info").json() == expected
    keyed = small_app(ServerConfig(api_key=KEY))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(keyed, "GET", "/get_server_info", headers=auth).json() == INFO
    assert call(keyed, "GET", "/get_server_info").status_code == 401


# -- content type ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content_type", "accepted"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("text/plain", False),
        ("text/plain;charset=UTF-8", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        (None, False),
    ],
)
def test_post_content_type(content_type: str | None, accepted: bool) -> None:
    app = small_app(ServerConfig())
    headers = {"Content-Type": content_type} if content_type else {}
    response = call(app, "POST", "/v1/completions", content=b'{"prompt": "x"}', headers=headers)
    if accepted:
        assert response.status_code == 200
        return
    assert_error(response, 415, repr(content_type) if content_type else "no Content-Type")
    assert app.state.received == 0


# -- body size ---------------------------------------------------------------------------------
def test_body_at_the_limit_is_read() -> None:
    app = small_app(ServerConfig(max_request_bytes=LIMIT))
    response = post(app, content=b"x" * LIMIT)
    assert response.json() == {"received": LIMIT}


def test_content_length_over_the_limit_is_refused_unread() -> None:
    app = small_app(ServerConfig(max_request_bytes=LIMIT))
    assert_error(post(app, content=b"x" * (LIMIT + 1)), 413, str(LIMIT + 1), str(LIMIT))
    assert app.state.received == 0


@pytest.mark.parametrize("chunk", [100, LIMIT, LIMIT + 1, 64 * 1024])
def test_chunked_body_over_the_limit_is_refused(chunk: int) -> None:
    app = small_app(ServerConfig(max_request_bytes=LIMIT))
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1000):
            sent += chunk
            yield b"x" * chunk

    response = post(app, content=body())
    assert_error(response, 413, str(LIMIT))
    assert app.state.received <= LIMIT
    assert sent <= LIMIT + chunk  # reading stopped at the chunk that went over


def test_chunked_body_at_the_limit_is_read() -> None:
    app = small_app(ServerConfig(max_request_bytes=LIMIT))

    async def body() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"x" * (LIMIT // 4)

    assert post(app, content=body()).json() == {"received": LIMIT}


# -- over a socket -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def socket_app() -> Iterator[tuple[str, FastAPI]]:
    """The small app on a real uvicorn (configured as ``tandem serve`` configures it)."""
    app = small_app(ServerConfig(max_request_bytes=LIMIT, api_key=KEY))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


BIG = 50 * 1024 * 1024
AUTH_JSON = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _refused_quickly(send: Any) -> None:
    """A 413 that closes the connection, within seconds of a 50 MB upload's start. The
    server may close while the client still writes; the client then sees the 413 or,
    when the reset overtakes it, a broken connection: either way the upload stopped."""
    started = time.monotonic()
    try:
        response = send()
    except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError):
        response = None
    assert time.monotonic() - started < 5
    if response is not None:
        assert_error(response, 413, str(LIMIT))


def test_big_upload_with_content_length_is_stopped(socket_app: tuple[str, FastAPI]) -> None:
    url, _ = socket_app
    with httpx.Client(timeout=10) as client:
        _refused_quickly(
            lambda: client.post(f"{url}/v1/completions", content=b"x" * BIG, headers=AUTH_JSON)
        )
        assert client.get(f"{url}/health").status_code == 200  # a new connection


def test_big_chunked_upload_is_stopped(socket_app: tuple[str, FastAPI]) -> None:
    url, app = socket_app
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(BIG // 65536):
            sent += 65536
            yield b"x" * 65536

    with httpx.Client(timeout=10) as client:
        _refused_quickly(
            lambda: client.post(f"{url}/v1/completions", content=body(), headers=AUTH_JSON)
        )
    assert sent < BIG // 2
    assert app.state.received <= LIMIT


def test_sse_is_not_buffered(socket_app: tuple[str, FastAPI]) -> None:
    url, app = socket_app
    app.state.release.clear()
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("GET", f"{url}/stream", headers=headers) as response,
    ):
        lines = response.iter_lines()
        assert next(lines) == "data: first"
        app.state.release.set()
        assert [line for line in lines if line] == ["data: second"]


# -- a live tandem serve -----------------------------------------------------------------------
def test_live_server_with_api_key(cache: Path) -> None:
    with live_server(cache, "--api-key", KEY) as server:
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.code == "invalid_api_key"
        right = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)
        assert [m.id for m in right.models.list().data] == ["tandem-tiny"]
        done = right.completions.create(model="tandem-tiny", prompt="Hello", max_tokens=2)
        assert done.usage is not None
        assert done.usage.completion_tokens == 2
        url = f"{server.url}/get_server_info"
        anonymous = httpx.get(url, timeout=10)
        assert anonymous.status_code == 401
        assert "model_path" not in anonymous.text
        assert "pid" not in anonymous.text
        info = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        assert Path(info["model_path"]).is_absolute()
        assert isinstance(info["scheduler_pid"], int)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
