"""OpenAI's error body, for every failure the server answers.

Clients (the ``openai`` package first) parse ``{"error": {...}}`` to raise typed
exceptions, so every 4xx/5xx, including FastAPI's own, is rendered in that one shape. A
500 never carries the exception's text: only an id that finds its traceback in the log.
"""

from __future__ import annotations

import logging
import uuid
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
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return JSONResponse(
            error_body(str(first.get("msg", "invalid request")), 400, ".".join(loc) or None), 400
        )

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = uuid.uuid4().hex
        log.exception(
            "internal error answering %s %s (request id %s)",
            request.method, request.url.path, request_id, exc_info=exc,
        )  # fmt: skip
        message = f"internal server error; the server log has the details under id {request_id}"
        return JSONResponse(error_body(message, 500), 500, headers={"X-Request-Id": request_id})

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
