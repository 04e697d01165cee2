"""OpenAI's error body, for every failure the server answers.

Clients (the ``openai`` package first) parse ``{"error": {...}}`` to raise typed
exceptions, so every 4xx/5xx, including FastAPI's own, is rendered in that one shape. A
500 never carries the exception's text: only an id that finds its traceback in the log.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger("tandem.server")

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to answer with ``status`` and OpenAI's body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def param_of(loc: Sequence[Any], body: Any, missing: bool = False) -> str | None:
    """A validation error's location as the field a client sent (``messages[0].content``),
    found by walking ``body`` along ``loc``: a step that names nothing in the body is a
    union member's label (``str``, ``role:user``) and is left out, except the last one of
    a ``missing`` error, the field the body lacks."""
    path, node = "", body
    for i, key in enumerate(loc):
        if isinstance(node, dict) and isinstance(key, str):
            if key not in node and not (missing and i == len(loc) - 1):
                continue
            path, node = (f"{path}.{key}" if path else key), node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            path, node = f"{path}[{key}]", node[key]
    return path or None


def from_validation(errors: Sequence[Any], body: Any) -> APIError:
    """One 400 for pydantic's validation ``errors`` of ``body``: the error on the deepest
    field (inside a union, the member that got furthest), the first among equals."""
    best: tuple[int, str | None, str] | None = None
    for error in errors:
        loc = list(error.get("loc", ()))
        if loc[:1] in (["query"], ["path"], ["header"], ["cookie"]):  # FastAPI's parameters
            param: str | None = ".".join(str(x) for x in loc)
        else:
            loc = loc[1:] if loc[:1] == ["body"] else loc
            param = param_of(loc, body, error.get("type") == "missing")
        tag = (error.get("ctx") or {}).get("discriminator", "")
        if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            tag = str(tag).strip("'")
            if tag.isidentifier():  # the field that picks the member: response_format.type
                param = f"{param}.{tag}" if param else tag
        depth = param.count(".") + param.count("[") + 1 if param else 0
        if best is None or depth > best[0]:
            best = (depth, param, str(error.get("msg", "invalid value")))
    if best is None:
        return APIError("the request is not valid")
    _, param, message = best
    return APIError(f"{param}: {message}" if param else message, param=param)


def allowed_methods(request: Request) -> list[str]:
    """The methods the app's routes accept on this request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Every route of the path, not only the first one the router tried.
            methods = allowed_methods(request)
            if methods:
                headers["Allow"] = ", ".join(methods)
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code), exc.status_code, headers=headers or None
        )

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        error = from_validation(exc.errors(), exc.body)
        return JSONResponse(error.body(), status_code=error.status)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex
        log.exception(
            "internal error answering %s %s (request id %s)",
            request.method, request.url.path, error_id, exc_info=exc,
        )  # fmt: skip
        message = f"internal server error; the server log has the details under id {error_id}"
        return JSONResponse(error_body(message, 500), 500, headers={"X-Request-Id": error_id})

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
