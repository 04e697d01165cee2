"""The checks every HTTP request passes before a route sees it, in this order: the
``Host`` header (against DNS rebinding of a loopback server), CORS (off unless origins
are configured), draining or a hung scheduler (503), the API key (401), a POST's content
type (415: a browser sends ``text/plain`` across origins without a preflight, so such a
body must never run) and the body size (413, never reading past the limit).

Plain ASGI, not ``BaseHTTPMiddleware``: responses, SSE streams included, pass through
unbuffered. Every refusal closes the connection, so an unread body is not drained.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.errors import error_body
from tandem.server.lifecycle import Lifecycle
from tandem.server.server_config import ServerConfig

_AUTHENTICATED = "tandem.authenticated"  # scope key: the request presented the API key
_OPEN_WHILE_NOT_ACCEPTING = ("/health", "/metrics")
# POST routes that take no body: sent without one (as a gateway sends /flush_cache), they
# need no content type, since there is no body a browser could have smuggled in.
_BODYLESS_POSTS = frozenset({"/flush_cache"})
_PATH_KEYS = frozenset(
    {"model_path", "tokenizer_path", "draft_model_path", "speculative_draft_model_path"}
)


def install_front_door(app: FastAPI, config: ServerConfig, lifecycle: Lifecycle) -> None:
    """Wrap ``app``'s routes in the checks, the ``Host`` check outermost."""
    # Each add_middleware call wraps the layers added before it.
    # The routes list fills in after this call; the gate reads it at the first request.
    app.add_middleware(Gate, config=config, lifecycle=lifecycle, routes=app.router.routes)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(HostCheck, allowed=config.host_allow_list)


def authenticated(conn: Scope | HTTPConnection) -> bool:
    """Whether an API key is configured and this request presented it."""
    scope = conn.scope if isinstance(conn, HTTPConnection) else conn
    return bool(scope.get(_AUTHENTICATED, False))


def public_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """``/get_server_info`` for a caller who did not present the key: without paths of
    the host's filesystem or process ids, which tell an attacker where to look."""
    return {k: _public(v) for k, v in info.items() if not _private(k, v)}


def _public(value: Any) -> Any:
    """A nested figure (``--dp-size``'s per-replica ``replicas``) filtered the same way."""
    if isinstance(value, Mapping):
        return public_info(value)
    if isinstance(value, list):
        return [_public(v) for v in value]
    return value


def _private(key: str, value: Any) -> bool:
    if key in _PATH_KEYS or key.endswith("pid"):
        return True
    return isinstance(value, str) and (
        PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute()
    )


def host_name(value: str) -> str:
    """The name part of a ``Host`` value, lower-cased: ``[::1]:30000`` gives ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:  # name:port; more colons is a bare IPv6 address
        return value.split(":", 1)[0]
    return value


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def _refuse(
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    response = JSONResponse(
        error_body(message, status, None, code),
        status_code=status,
        headers={"Connection": "close", **(headers or {})},
    )
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class HostCheck:
    """Refuses a ``Host`` outside the allow list. A page served from a name the attacker
    controls can re-point that name at 127.0.0.1; its requests then still carry the
    attacker's name, and are refused here."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.anything = not allowed or "*" in allowed
        self.allowed = frozenset(host_name(h) for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.anything:
            await self.app(scope, receive, send)
            return
        raw = _header(scope, b"host")
        value = raw.decode("latin-1") if raw is not None else None
        if value is None or host_name(value) not in self.allowed:
            named = "no Host header" if value is None else f"the Host header {value!r}"
            await _refuse(send, 400, f"{named} is not allowed here (see --allowed-hosts)")
            return
        await self.app(scope, receive, send)


class Gate:
    """Draining, the API key, the content type and the body size, checked in that order."""

    def __init__(
        self, app: ASGIApp, config: ServerConfig, lifecycle: Lifecycle, routes: list[Any]
    ) -> None:
        self.app = app
        self.routes = routes
        self._post_paths: frozenset[str] | None = None
        self.lifecycle = lifecycle
        self.key = config.api_key.encode() if config.api_key else None
        self.open_paths = ("/health", "/metrics") if config.metrics_without_auth else ("/health",)
        self.limit = config.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        life = self.lifecycle
        if not life.accepting and not (
            method in ("GET", "HEAD") and path in _OPEN_WHILE_NOT_ACCEPTING
        ):
            message = (
                "the server is shutting down"
                if life.draining
                else f"the scheduler is not responding: {life.hung}"
            )
            await _refuse(send, 503, message)
            return
        if self.key is not None:
            presented = _bearer(scope)
            if presented is not None and hmac.compare_digest(presented, self.key):
                scope[_AUTHENTICATED] = True
            elif path not in self.open_paths:
                message = (
                    "missing API key: send the header Authorization: Bearer <key>"
                    if presented is None
                    else "incorrect API key provided"
                )
                await _refuse(send, 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
        if method == "POST" and path in self.post_paths and not _bodyless(scope, path):
            raw = _header(scope, b"content-type")
            media = (raw or b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                named = f"Content-Type {raw.decode('latin-1')!r}" if raw else "no Content-Type"
                await _refuse(send, 415, f"{named} is not supported: send application/json")
                return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            await _refuse(send, 413, self._too_large(f"{int(length)} bytes"))
            return
        await self._limited(scope, receive, send)

    @property
    def post_paths(self) -> frozenset[str]:
        """Paths with a POST route: elsewhere a POST is the router's 405, not a 415."""
        if self._post_paths is None:
            self._post_paths = frozenset(
                r.path for r in self.routes if "POST" in (getattr(r, "methods", None) or ())
            )
        return self._post_paths

    def _too_large(self, size: str) -> str:
        return f"the request body ({size}) is over the limit of {self.limit} bytes"

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, handing it at most ``limit`` body bytes. A body without
        Content-Length (chunked) that grows past the limit is answered 413; the app
        then sees a disconnect, as if the client had gone."""
        seen = 0
        started = False
        refused = False  # over the limit: the app is told the client left
        answered = False  # and the 413 went out, so the app's own response must not

        async def limited_receive() -> Message:
            nonlocal seen, refused, answered
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    if not started:
                        answered = True
                        await _refuse(send, 413, self._too_large(f"over {self.limit} bytes"))
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except ClientDisconnect:
            if not refused:
                raise


def _bodyless(scope: Scope, path: str) -> bool:
    """A POST without a body to a route that takes none."""
    if path not in _BODYLESS_POSTS:
        return False
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() == b"0"
    return _header(scope, b"transfer-encoding") is None


def _bearer(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer`` header; ``None`` without one."""
    raw = _header(scope, b"authorization")
    if raw is None:
        return None
    scheme, _, token = raw.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
