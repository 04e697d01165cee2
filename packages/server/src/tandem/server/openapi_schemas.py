"""JSON schemas of the request bodies and the answers, for ``/openapi.json`` only.

The routes read raw JSON and ``parsing`` validates it (so that a bad field is an
OpenAI-shaped 400 naming it); these schemas never validate anything at run time. They
describe what the parser accepts, with its types and ranges, and the statuses each route
answers, for clients and schema-driven fuzzers. Bounds of the loaded model (vocabulary,
context length) and of the server's options (``max_choices``) are filled in by
``document``. See docs/guides/serving.md, "The request schema".
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tandem.server.parsing import Limits

MAX_N = 128  # parsing.MAX_N
MAX_TOP_LOGPROBS = 20  # parsing.MAX_TOP_LOGPROBS
INT_LOW, INT_HIGH = -(9 * 10**18), 9 * 10**18  # parsing's bounds on top_k and seeds

# A schema carrying this key gets a bound ``document`` knows once the server runs:
# token_id: maximum vocab_size - 1; tokens: maximum context_length - 1; prompt: maxItems
# context_length - 1; stop_count and stop_length: the stop limits (maxItems, maxLength);
# choices: maxItems max_choices. And room: maximum ROOM_MAX, set there
# because FastAPI writes the bounds it is given as doubles, and 2**64 - 1 is none.
_BOUND = "x-tandem-bound"

_NUMBER: dict[str, Any] = {"type": "number"}
_TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, _BOUND: "token_id"}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": _TOKEN_ID, "minItems": 1, _BOUND: "prompt"}
_MAX_TOKENS: dict[str, Any] = {"type": "integer", "minimum": 0, _BOUND: "tokens"}
_STOP_STRING: dict[str, Any] = {"type": "string", _BOUND: "stop_length"}
_STOP: dict[str, Any] = {
    "description": "Stop string(s); empty strings are ignored.",
    "anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, _BOUND: "stop_count"}],
}
_PENALTY: dict[str, Any] = {"type": "number", "minimum": -2, "maximum": 2}
_NULLABLE_BOOL: dict[str, Any] = {"type": ["boolean", "null"]}
_TOP_K: dict[str, Any] = {
    "type": "integer", "minimum": -1, "maximum": INT_HIGH, "description": "-1 or 0: off.",
}  # fmt: skip
_SEED: dict[str, Any] = {
    "type": "integer",
    "minimum": INT_LOW,
    "maximum": INT_HIGH,
    "description": "Choice i is sampled with seed + i.",
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_GRAMMAR_NOTE = (
    " At most one grammar per request; one the engine cannot compile is a 400 (see "
    "docs/guides/structured-outputs.md)."
)
_GRAMMAR_TEXTS = {
    "regex": "The output matches this regular expression.",
    "ebnf": "The output follows this EBNF grammar (from its rule root).",
    "json_schema": "The output is JSON matching this JSON Schema (its JSON text).",
    "structural_tag": "xgrammar's structural tag (its JSON text): free text with tagged parts.",
}
# SGLang's grammar fields in /generate's sampling_params: strings.
_GRAMMARS: dict[str, Any] = {
    k: {"type": "string", "description": text + _GRAMMAR_NOTE} for k, text in _GRAMMAR_TEXTS.items()
}
# The same at the top of an OpenAI body, where a JSON one may also be the object itself.
_OPENAI_GRAMMARS: dict[str, Any] = {
    k: _nullable(
        {**v, "type": ["string", "object"]} if k in ("json_schema", "structural_tag") else v
    )
    for k, v in _GRAMMARS.items()
}
_OBJECT_OR_NULL: dict[str, Any] = {"type": ["object", "null"]}
RESPONSE_FORMAT: dict[str, Any] = {
    "description": "text (free), json_object (any JSON object), json_schema (JSON matching "
    "json_schema.schema) or SGLang's structural_tag; not with another grammar field.",
    "oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"const": "json_object"},
                "schema": {"type": "null", "description": "json_object takes no schema."},
                "json_schema": {"type": "null", "description": "json_object takes no schema."},
            },
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["name", "schema"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "description": {"type": ["string", "null"]},
                        "strict": {
                            "type": ["boolean", "null"],
                            "description": "Accepted; the schema is always enforced.",
                        },
                        "schema": {"type": "object", "description": "A JSON Schema."},
                    },
                },
            },
        },
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"const": "structural_tag"}},
            "anyOf": [{"required": ["format"]}, {"required": ["structures"]}],
        },
    ],
}


def _function_tool(**function: Any) -> dict[str, Any]:
    """``{"type": "function", "function": {"name": ..., **function}}``'s schema."""
    return {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": function},
        },
    }


TOOLS: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "description": "Function tools; names are unique.",
    "items": _function_tool(
        name={"type": "string", "minLength": 1},
        description={"type": ["string", "null"]},
        parameters={**_OBJECT_OR_NULL, "description": "A JSON Schema."},
        strict={"type": ["boolean", "null"]},
    ),
}
TOOL_CHOICE: dict[str, Any] = {
    "description": "required and a named function need tools, and the function must be one "
    "of them; default: auto with tools, none without.",
    "anyOf": [{"enum": ["none", "auto", "required"]}, _function_tool(name={"type": "string"})],
}

# Sampling fields shared by /v1/completions and /v1/chat/completions (``null`` is "unset").
_OPENAI_SAMPLING: dict[str, Any] = {
    "model": _nullable({"type": "string", "description": "The served model's name."}),
    "max_tokens": _nullable(_MAX_TOKENS),
    "max_completion_tokens": _nullable(
        {**_MAX_TOKENS, "description": "Takes precedence over max_tokens."}
    ),
    "temperature": _nullable({"type": "number", "minimum": 0}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable(_TOP_K),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
    "frequency_penalty": _nullable(_PENALTY),
    "presence_penalty": _nullable(_PENALTY),
    "n": _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_N,
            "description": "Choices per prompt; prompts x n may not pass the server's max_choices.",
        }
    ),
    "stop": _nullable(_STOP),
    "stop_token_ids": _nullable({"type": "array", "items": _TOKEN_ID}),
    "seed": _nullable(_SEED),
    "stream": _NULLABLE_BOOL,
    "stream_options": _nullable(
        {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
            "description": "Read only when stream is true.",
        }
    ),
    "ignore_eos": _NULLABLE_BOOL,
    "skip_special_tokens": _NULLABLE_BOOL,
    "user": _nullable({"type": "string", "description": "Accepted and ignored."}),
    "response_format": _nullable(RESPONSE_FORMAT),
    **_OPENAI_GRAMMARS,
}

COMPLETION_REQUEST: dict[str, Any] = {
    "title": "CompletionRequest",
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {
            "description": "Text, texts, token ids, or lists of token ids (one choice set each).",
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1, _BOUND: "choices"},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1, _BOUND: "choices"},
            ],
        },
        **_OPENAI_SAMPLING,
        "logprobs": _nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_TOP_LOGPROBS,
                "description": "Return logprobs with this many alternatives per token.",
            }
        ),
        "echo": {
            "type": ["boolean", "null"],
            "description": "Return the prompt before the completion: its text, and with "
            "logprobs its tokens' logprobs (null for the first).",
        },
    },
}

_TEXT_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

CHAT_COMPLETION_REQUEST: dict[str, Any] = {
    "title": "ChatCompletionRequest",
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string"},
                    "content": {
                        "description": "Text, or text parts; null is refused, except in an "
                        "assistant message with tool_calls.",
                        "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}],
                    },
                },
            },
        },
        **_OPENAI_SAMPLING,
        "tools": _nullable(TOOLS),
        "tool_choice": _nullable(TOOL_CHOICE),
        "parallel_tool_calls": _nullable(
            {"type": "boolean", "description": "false: at most one call (default true)."}
        ),
        "logprobs": _NULLABLE_BOOL,
        "top_logprobs": _nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_TOP_LOGPROBS,
                "description": "Needs logprobs: true when > 0.",
            }
        ),
    },
    # top_logprobs > 0 needs logprobs: true.
    "anyOf": [
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        {"properties": {"top_logprobs": {"enum": [0, None]}}},
    ],
}

# SGLang's sampling_params: unknown keys are a 400 (``parsing.NATIVE_SAMPLING_KEYS``).
SAMPLING_PARAMS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "max_new_tokens": _MAX_TOKENS,
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": _TOP_K,
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "frequency_penalty": _PENALTY,
        "presence_penalty": _PENALTY,
        "stop": _nullable(_STOP),
        "stop_token_ids": _nullable({"type": "array", "items": _TOKEN_ID}),
        "ignore_eos": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "seed": _nullable({"type": "integer", "minimum": INT_LOW, "maximum": INT_HIGH}),
        "sampling_seed": _nullable(
            {
                "type": "integer",
                "minimum": INT_LOW,
                "maximum": INT_HIGH,
                "description": "Alias of seed.",
            }
        ),
        "n": {"type": "integer", "const": 1},
        **{k: _nullable(v) for k, v in _GRAMMARS.items()},
    },
    "not": {
        "description": "seed and sampling_seed together",
        "required": ["seed", "sampling_seed"],
        "properties": {"seed": {"type": "integer"}, "sampling_seed": {"type": "integer"}},
    },
}

GENERATE_REQUEST: dict[str, Any] = {
    "title": "GenerateRequest",
    "type": "object",
    "description": "SGLang's native request: exactly one of text and input_ids (null is absent).",
    "oneOf": [
        {"required": ["text"], "properties": {"text": {"type": "string"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
    ],
    "properties": {
        "text": _nullable({"type": "string", "minLength": 1}),
        "input_ids": _nullable(_TOKEN_IDS),
        "sampling_params": _nullable(SAMPLING_PARAMS),
        "stream": _NULLABLE_BOOL,
        "return_logprob": _NULLABLE_BOOL,
        "top_logprobs_num": _nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_TOP_LOGPROBS,
                "description": "Alternatives per token, at most 20 as in OpenAI's API.",
            }
        ),
        "rid": _nullable(
            {"type": "string", "minLength": 1, "description": "Request id, for aborts."}
        ),
        "logprob_start_len": _nullable(
            {
                "type": "integer",
                "minimum": -1,
                "maximum": INT_HIGH,
                "description": "With return_logprob: the prompt position from which the "
                "prompt's logprobs come back (input_token_logprobs); below the prompt's "
                "length. -1 (the default): none.",
            }
        ),
        "return_text_in_logprobs": {
            "type": ["boolean", "null"],
            "description": "Each logprob entry's third element is its token's text.",
        },
    },
}


# -- prefill/decode disaggregation -------------------------------------------------------------
ROOM_MAX = 2**64 - 1  # parsing.ROOM_MAX
BOOTSTRAP_HOST_PATTERN = r"^[A-Za-z0-9._:%\[\]-]+$"  # parsing.BOOTSTRAP_HOST_PATTERN
_BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_BOOTSTRAP_TYPES: dict[str, dict[str, Any]] = {
    "bootstrap_host": {
        "type": "string", "minLength": 1, "maxLength": 255, "pattern": BOOTSTRAP_HOST_PATTERN,
        "description": "The prefill server's bootstrap host (a name or an IP address).",
    },
    "bootstrap_port": {
        "type": "integer", "minimum": 1, "maximum": 65535,
        "description": "The prefill server's bootstrap port (--disaggregation-bootstrap-port).",
    },
    "bootstrap_room": {
        "type": "integer", "minimum": 0, _BOUND: "room",
        "description": "Pairs the prefill and the decode half of this request (unsigned 64-bit).",
    },
}  # fmt: skip
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


def with_bootstrap(schema: dict[str, Any], required: bool) -> dict[str, Any]:
    """``schema`` with the bootstrap fields; ``required``: on a prefill or decode server,
    where every request carries them."""
    given: dict[str, Any] = {
        "required": list(_BOOTSTRAP_FIELDS),
        "properties": {
            **{name: {"not": {"type": "null"}} for name in _BOOTSTRAP_FIELDS},
            **_ONE_SEQUENCE.get(schema.get("title", ""), {}),
        },
    }
    absent = {"properties": {name: {"type": "null"} for name in _BOOTSTRAP_FIELDS}}
    out = {**schema, "properties": {**schema["properties"]}}
    for name, field in _BOOTSTRAP_TYPES.items():
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


_ERROR = _error("the error")
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


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body ``schema`` describes (documentation
    only: the route still parses the raw body itself)."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": _GENERATED, "400": _BAD_REQUEST, "413": _TOO_LARGE, "415": _MEDIA_TYPE,
            "503": _UNAVAILABLE,
        },
    }  # fmt: skip


def openai_body(
    schema: dict[str, Any], model_name: str, bootstrap_required: bool = False
) -> dict[str, Any]:
    """``json_body`` of an OpenAI route whose ``model`` must be ``model_name`` when given
    (any other name is a 404, ``model_not_found``), with the bootstrap fields
    (``with_bootstrap``)."""
    model = {"const": model_name, "description": "The served model; may be left out."}
    schema = with_bootstrap(schema, bootstrap_required)
    named = {**schema, "properties": {**schema["properties"], "model": _nullable(model)}}
    extra = json_body(named)
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
    "responses": {"200": {"description": "SGLang's fields (see gateway.py)", "content": _OBJECT}}
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
        "room": ("maximum", ROOM_MAX),
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
