"""JSON schemas of the request bodies, for ``/openapi.json`` only.

The routes read raw JSON and ``parsing`` validates it (so that a bad field is an
OpenAI-shaped 400 naming it); these schemas never validate anything at run time. They
describe what the parser accepts, with its types and ranges, for clients and
schema-driven fuzzers. Bounds that depend on the loaded model (token ids, prompt
length) are checked at run time only. See docs/guides/serving.md, "The request
schema".
"""

from __future__ import annotations

from typing import Any

MAX_N = 128  # parsing.MAX_N
MAX_TOP_LOGPROBS = 20  # parsing.MAX_TOP_LOGPROBS
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # parsing's bounds on top_k and seed

_NUMBER: dict[str, Any] = {"type": "number"}
_TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
_STOP: dict[str, Any] = {
    "description": "Stop string(s); empty strings are ignored.",
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
}
_PENALTY: dict[str, Any] = {"type": "number", "minimum": -2, "maximum": 2}
_NULLABLE_BOOL: dict[str, Any] = {"type": ["boolean", "null"]}
_TOP_K: dict[str, Any] = {
    "type": "integer", "minimum": -1, "maximum": INT64_MAX, "description": "-1 or 0: off.",
}  # fmt: skip
_SEED: dict[str, Any] = {
    "type": "integer",
    "minimum": INT64_MIN,
    "maximum": INT64_MAX,
    "description": "Choice i is sampled with seed + i, which must fit in 64 bits too.",
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# Sampling fields shared by /v1/completions and /v1/chat/completions (``null`` is "unset").
_OPENAI_SAMPLING: dict[str, Any] = {
    "model": _nullable({"type": "string", "description": "The served model's name."}),
    "max_tokens": _nullable({"type": "integer", "minimum": 0}),
    "max_completion_tokens": _nullable(
        {"type": "integer", "minimum": 0, "description": "Takes precedence over max_tokens."}
    ),
    "temperature": _nullable({"type": "number", "minimum": 0}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable(_TOP_K),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
    "frequency_penalty": _nullable(_PENALTY),
    "presence_penalty": _nullable(_PENALTY),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
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
    "user": {"type": "string", "description": "Accepted and ignored."},
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
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
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
        "echo": {"type": ["boolean", "null"], "enum": [False, None], "description": "Unsupported."},
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
                "required": ["role"],
                "properties": {
                    "role": {"type": "string"},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "items": _TEXT_PART},
                            {"type": "null"},
                        ]
                    },
                },
            },
        },
        **_OPENAI_SAMPLING,
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
}

# SGLang's sampling_params: unknown keys are a 400 (``SamplingParams.from_dict``).
SAMPLING_PARAMS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 0},
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
        "seed": _nullable(_SEED),
        "sampling_seed": _nullable({**_SEED, "description": "Alias of seed."}),
        "n": {"type": "integer", "const": 1},
    },
}

GENERATE_REQUEST: dict[str, Any] = {
    "title": "GenerateRequest",
    "type": "object",
    "description": "SGLang's native request: exactly one of text and input_ids.",
    "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
    "properties": {
        "text": {"type": "string", "minLength": 1},
        "input_ids": _TOKEN_IDS,
        "sampling_params": _nullable(SAMPLING_PARAMS),
        "stream": _NULLABLE_BOOL,
        "return_logprob": _NULLABLE_BOOL,
        "top_logprobs_num": _nullable({"type": "integer", "minimum": 0}),
        "rid": _nullable({"type": "string", "description": "Request id, for aborts."}),
    },
}


_ERROR: dict[str, Any] = {
    "description": "OpenAI's error body",
    "content": {
        "application/json": {
            "schema": {
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
        }
    },
}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body ``schema`` describes (documentation
    only: the route still parses the raw body itself)."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"400": _ERROR, "503": _ERROR},
    }


def openai_body(schema: dict[str, Any], model_name: str) -> dict[str, Any]:
    """``json_body`` of an OpenAI route whose ``model`` must be ``model_name`` when given
    (any other name is a 404, ``model_not_found``)."""
    model = {"const": model_name, "description": "The served model; may be left out."}
    named = {**schema, "properties": {**schema["properties"], "model": _nullable(model)}}
    extra = json_body(named)
    extra["responses"]["404"] = _ERROR
    return extra


UNAVAILABLE: dict[str, Any] = {"responses": {"503": _ERROR}}
