"""``/openapi.json``: the request bodies, from the models of ``request_models``, and the answers.

The routes read the raw body themselves (``parsing`` checks it before pydantic sees it),
so each route's body schema is given as ``openapi_extra``: the model's own schema, made
self-contained, with the bootstrap fields of the server's mode. Bounds of the loaded
model (vocabulary, context length) and of the server's options (``max_choices``) are
filled in by ``document``. See docs/guides/serving.md, "The request schema".
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from tandem.server import request_models

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tandem.server.parsing import Limits

# A schema carrying ``request_models.BOUND`` gets a bound ``document`` knows once the server runs:
# token_id: maximum vocab_size - 1; tokens: maximum context_length - 1; prompt: maxItems
# context_length - 1; stop_count and stop_length: the stop limits (maxItems, maxLength);
# choices: maxItems max_choices. And room: maximum ROOM_MAX, set there because FastAPI
# writes the bounds it is given as doubles, and 2**64 - 1 is none.
_BOUND = request_models.BOUND


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema as a request body's, self-contained: its ``$defs`` inlined
    (none of the request models refers to itself), without titles and null defaults (a
    field's ``None`` default means absent)."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return inline({**defs[ref.removeprefix("#/$defs/")], **rest})
        out = {}
        for key, value in node.items():
            if key == "$defs" or (key == "title" and isinstance(value, str)):
                continue
            if key == "default" and value is None:
                continue
            if key == "properties":  # its keys are field names, not keywords
                out[key] = {name: inline(v) for name, v in value.items()}
            else:
                out[key] = inline(value)
        return out

    return inline(schema)  # type: ignore[no-any-return]


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# -- prefill/decode disaggregation -------------------------------------------------------------
_BOOTSTRAP_NOTE = (
    "Prefill/decode disaggregation (SGLang's fields, which a gateway such as `smg launch "
    "--pd-disaggregation` adds): bootstrap_host, bootstrap_port and bootstrap_room come "
    "together or not at all, and with them a request generates one sequence. (SGLang's "
    "batch form is taken too, undescribed here: on /v1/completions with a list of prompts, "
    "each field a list of one value per prompt, the rooms all different.)"
)
# What a request with bootstrap fields may ask for besides: one sequence.
_ONE_SEQUENCE: dict[str, dict[str, Any]] = {
    "CompletionRequest": {
        "n": {"enum": [1, None]},
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "maxItems": 1},
            ]
        },
    },
    "ChatCompletionRequest": {"n": {"enum": [1, None]}},
}


def with_bootstrap(schema: dict[str, Any], model: str, required: bool) -> dict[str, Any]:
    """``schema`` (of the request ``model``) with the bootstrap fields; ``required``: on a
    prefill or decode server, where every request carries them."""
    given: dict[str, Any] = {
        "required": list(request_models.BOOTSTRAP_TYPES),
        "properties": {
            **{name: {"not": {"type": "null"}} for name in request_models.BOOTSTRAP_TYPES},
            **_ONE_SEQUENCE.get(model, {}),
        },
    }
    absent = {"properties": {name: {"type": "null"} for name in request_models.BOOTSTRAP_TYPES}}
    out = {**schema, "properties": {**schema["properties"]}}
    for name, adapter in request_models.BOOTSTRAP_TYPES.items():
        field = adapter.json_schema()
        out["properties"][name] = field if required else _nullable(field)
    out["allOf"] = [*schema.get("allOf", []), given if required else {"anyOf": [given, absent]}]
    note = "Every request carries the bootstrap fields here." if required else ""
    texts = (schema.get("description", ""), _BOOTSTRAP_NOTE, note)
    out["description"] = " ".join(text for text in texts if text)
    return out


# -- answers -------------------------------------------------------------------------------------
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _error(description: str, **headers: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": f"OpenAI's error body: {description}",
        "content": {"application/json": {"schema": _ERROR_SCHEMA}},
    }
    if headers:
        out["headers"] = {
            name: {"description": text, "schema": {"type": "string"}}
            for name, text in headers.items()
        }
    return out


_BAD_REQUEST = _error(
    "a field the server refuses (param names it), a body that is not JSON, or a Host header "
    "that is not allowed"
)
_UNAUTHORIZED = _error(
    "the API key is missing or wrong (only when the server has one)",
    **{"WWW-Authenticate": "Bearer"},
)
_NOT_FOUND = _error("no model of that name (code model_not_found)")
_NOT_ALLOWED = _error("another method than this path takes", Allow="The methods this path takes")
_TOO_LARGE = _error("the body is over the server's size limit (--max-request-bytes)")
_MEDIA_TYPE = _error("the body is not sent as application/json")
_UNAVAILABLE = _error(
    "the scheduler is not running or not responding, or the server is shutting down"
)
_GENERATED: dict[str, Any] = {
    "description": "The result; with stream: true, server-sent events ending in [DONE]",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {
            "schema": {
                "description": "One event: data is a JSON chunk, or [DONE] at the end",
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            }
        },
    },
}


def json_body(model: type[BaseModel], bootstrap_required: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is the request ``model``, with the
    bootstrap fields (``with_bootstrap``). The route reads the raw body itself (checked
    before pydantic sees it: ``parsing.load_json``), so FastAPI does not see the model."""
    schema = with_bootstrap(request_schema(model), model.__name__, bootstrap_required)
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": _GENERATED, "400": _BAD_REQUEST, "413": _TOO_LARGE, "415": _MEDIA_TYPE,
            "503": _UNAVAILABLE,
        },
    }  # fmt: skip


def openai_body(
    model: type[BaseModel], model_name: str, bootstrap_required: bool = False
) -> dict[str, Any]:
    """``json_body`` of an OpenAI route whose ``model`` must be ``model_name`` when given
    (any other name is a 404, ``model_not_found``)."""
    name = {"const": model_name, "description": "The served model; may be left out."}
    extra = json_body(model, bootstrap_required)
    schema = extra["requestBody"]["content"]["application/json"]["schema"]
    schema["properties"]["model"] = _nullable(name)
    extra["responses"]["404"] = _NOT_FOUND
    return extra


UNAVAILABLE: dict[str, Any] = {"responses": {"503": _UNAVAILABLE}}

HEALTH: dict[str, Any] = {
    "responses": {
        "200": {
            "description": "The server takes requests",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["status"],
                        "properties": {"status": {"const": "ok"}},
                    }
                }
            },
        },
        "503": _UNAVAILABLE,
    }
}


_OBJECT = {"application/json": {"schema": {"type": "object"}}}
GATEWAY_INFO: dict[str, Any] = {
    "responses": {
        "200": {"description": "SGLang's fields (see routes/gateway.py)", "content": _OBJECT}
    }
}
FLUSH_CACHE: dict[str, Any] = {
    "responses": {
        "200": {"description": "The radix cache was emptied", "content": _OBJECT},
        "400": _error("not flushed: requests are queued or running (code server_busy)"),
        "503": _UNAVAILABLE,
    }
}


def document(app: FastAPI, limits: Callable[[], Limits | None], max_choices: int) -> None:
    """Make ``app.openapi()`` carry what every route may answer (400 for a refused Host,
    401, 405, 503 while draining; ``/metrics`` as text) and the bounds of the loaded model,
    once ``limits()`` knows them."""
    plain = app.openapi
    built: dict[bool, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        known = limits()
        if (known is not None) not in built:
            schema = copy.deepcopy(plain())
            _answers(schema)
            _bounds(schema, known, max_choices)
            built[known is not None] = schema
        return built[known is not None]

    app.openapi = openapi  # type: ignore[method-assign]


def _answers(schema: dict[str, Any]) -> None:
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            responses.setdefault("400", _BAD_REQUEST)
            if path != "/health":
                responses.setdefault("401", _UNAUTHORIZED)
            responses.setdefault("405", _NOT_ALLOWED)
            if path != "/metrics":
                responses.setdefault("503", _UNAVAILABLE)
            if method == "post":
                responses.setdefault("413", _TOO_LARGE)
                responses.setdefault("415", _MEDIA_TYPE)
        metrics = item.get("get") if path == "/metrics" else None
        if metrics is not None:
            metrics["responses"]["200"] = {
                "description": "Prometheus's text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }


def _bounds(schema: dict[str, Any], limits: Limits | None, max_choices: int) -> None:
    values: dict[str, tuple[str, int]] = {
        "choices": ("maxItems", max_choices),
        "room": ("maximum", request_models.ROOM_MAX),
    }
    if limits is not None:
        values["token_id"] = ("maximum", limits.vocab_size - 1)
        values["tokens"] = ("maximum", limits.context_length - 1)
        values["prompt"] = ("maxItems", limits.context_length - 1)
        values["stop_count"] = ("maxItems", limits.stop.max_count)
        values["stop_length"] = ("maxLength", limits.stop.max_length)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kind = node.pop(_BOUND, None)
            if kind in values:
                keyword, value = values[kind]
                node[keyword] = value
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
