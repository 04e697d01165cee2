"""The request bodies of ``/v1/completions``, ``/v1/chat/completions`` and ``/generate``.

These pydantic models are both the field checks (``validate``: types and static bounds,
strict, so ``"5"`` is no integer) and the request schemas of ``/openapi.json``
(``body_schema``). Unknown top-level fields are ignored, as OpenAI clients send them;
``sampling_params`` refuses them, as SGLang does. What depends on the loaded model or on
several fields (prompt length, stop limits, choices, the bootstrap set) is checked by
``parsing``, and ``openapi_schemas.document`` writes those bounds into the schema.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from tandem.server.errors import from_validation

MAX_N = 128
MAX_TOP_LOGPROBS = 20
# The bounds of 64-bit fields (top_k, seeds), a little inside int64 and round in decimal:
# schema tools read big numbers as doubles (2**63 - 1 is the double 2**63), and 9e18 is
# the same number either way. Seed + i (i < MAX_N) still fits.
INT_LOW, INT_HIGH = -(9 * 10**18), 9 * 10**18
ROOM_MAX = 2**64 - 1  # rooms are unsigned 64-bit (SGLang's gateway draws them so)
MAX_BOOTSTRAP_HOST = 255  # the longest DNS name
BOOTSTRAP_HOST_PATTERN = r"^[A-Za-z0-9._:%\[\]-]+$"  # names, IPv4, IPv6 (bracketed or not)

# A schema carrying this key gets a bound ``openapi_schemas.document`` knows once the
# server runs (token_id, tokens, prompt, choices, stop_count, stop_length, room).
BOUND = "x-tandem-bound"


def _integral(value: Any) -> Any:
    """JSON has one number type: ``5.0`` is the integer 5 (as JSON Schema, and OpenAI's
    own server, read it)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(
    low: int | None = None, high: int | None = None, bound: str | None = None, **kw: Any
) -> Any:
    extra = {BOUND: bound} if bound else None
    return Annotated[
        int, Field(ge=low, le=high, json_schema_extra=extra, **kw), BeforeValidator(_integral)
    ]


def _real(**kw: Any) -> Any:
    return Annotated[float, Field(**kw)]


TokenId = _int(0, bound="token_id")
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra={BOUND: "prompt"})]
MaxTokens = _int(0, bound="tokens")
Penalty = _real(ge=-2, le=2)
TopK = _int(-1, INT_HIGH, description="-1 or 0: off.")
Seed = _int(INT_LOW, INT_HIGH, description="Choice i is sampled with seed + i.")
TopLogprobs = _int(0, MAX_TOP_LOGPROBS)
StopString = Annotated[str, Field(json_schema_extra={BOUND: "stop_length"})]
Stop = Annotated[
    StopString | Annotated[list[StopString], Field(json_schema_extra={BOUND: "stop_count"})],
    Field(description="Stop string(s); empty strings are ignored."),
]
BootstrapHost = Annotated[
    str,
    Field(
        min_length=1, max_length=MAX_BOOTSTRAP_HOST, pattern=BOOTSTRAP_HOST_PATTERN,
        description="The prefill server's bootstrap host (a name or an IP address).",
    ),
]  # fmt: skip
BootstrapPort = _int(
    1, 65535, description="The prefill server's bootstrap port (--disaggregation-bootstrap-port)."
)


def _room(value: int) -> int:
    if value > ROOM_MAX:
        raise ValueError(f"must be at most {ROOM_MAX}")
    return value


# Its maximum is written into the schema by ``openapi_schemas.document`` (bound "room"):
# FastAPI would write 2**64 - 1 as a double, which is 2**64.
BootstrapRoom = Annotated[
    _int(0, bound="room", description="Pairs the prefill and the decode half of this request "
         "(unsigned 64-bit)."),
    AfterValidator(_room),
]  # fmt: skip
# Checked one value at a time by ``parsing.bootstrap`` (which may take a list per prompt).
BOOTSTRAP_TYPES: dict[str, TypeAdapter[Any]] = {
    "bootstrap_host": TypeAdapter(BootstrapHost), "bootstrap_port": TypeAdapter(BootstrapPort),
    "bootstrap_room": TypeAdapter(BootstrapRoom),
}  # fmt: skip

_GRAMMAR_NOTE = (
    " At most one grammar per request; one the engine cannot compile is a 400 (see "
    "docs/guides/structured-outputs.md)."
)
_REGEX = "The output matches this regular expression." + _GRAMMAR_NOTE
_EBNF = "The output follows this EBNF grammar (from its rule root)." + _GRAMMAR_NOTE
_JSON_SCHEMA = "The output is JSON matching this JSON Schema (its JSON text)." + _GRAMMAR_NOTE
_STRUCTURAL_TAG = (
    "xgrammar's structural tag (its JSON text): free text with tagged parts." + _GRAMMAR_NOTE
)


M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    """Strict JSON types (no ``"5"`` for 5, no ``1`` for true); unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


# -- OpenAI's shared fields ----------------------------------------------------------------------
class StreamOptions(_Body):
    """Read only when stream is true."""

    include_usage: bool | None = None


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]
    schema_: None = Field(None, alias="schema", description="json_object takes no schema.")
    json_schema: None = Field(None, description="json_object takes no schema.")


class JsonSchemaSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema.")


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuralTagFormat(_Body):
    """xgrammar's structural tag: a ``format``, or ``structures`` and ``triggers``."""

    model_config = ConfigDict(
        json_schema_extra={"anyOf": [{"required": ["format"]}, {"required": ["structures"]}]}
    )
    type: Literal["structural_tag"]


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | StructuralTagFormat,
    Field(
        discriminator="type",
        description="text (free), json_object (any JSON object), json_schema (JSON matching "
        "json_schema.schema) or SGLang's structural_tag; not with another grammar field.",
    ),
]


class OpenAIRequest(_Body):
    """Sampling fields of both OpenAI routes (``null`` is "unset"), with SGLang's and
    vLLM's extensions (top_k, min_p, ..., the grammar fields)."""

    model: str | None = Field(None, description="The served model's name.")
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = Field(
        None, description="Takes precedence over max_tokens."
    )
    temperature: _real(ge=0) | None = None
    top_p: _real(gt=0, le=1) | None = None
    top_k: TopK | None = None
    min_p: _real(ge=0, le=1) | None = None
    repetition_penalty: _real(gt=0) | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    n: _int(1, MAX_N) | None = Field(
        None, description="Choices per prompt; prompts x n may not pass the server's max_choices."
    )
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = Field(None, description="Accepted and ignored.")
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, description=_REGEX)
    ebnf: str | None = Field(None, description=_EBNF)
    json_schema: str | dict[str, Any] | None = Field(None, description=_JSON_SCHEMA)
    structural_tag: str | dict[str, Any] | None = Field(None, description=_STRUCTURAL_TAG)


class CompletionRequest(OpenAIRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, json_schema_extra={BOUND: "choices"})]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, json_schema_extra={BOUND: "choices"})]
    ) = Field(description="Text, texts, token ids, or lists of token ids (one choice set each).")
    logprobs: TopLogprobs | None = Field(
        None, description="Return logprobs with this many alternatives per token."
    )
    echo: bool | None = Field(
        None,
        description="Return the prompt before the completion: its text, and with logprobs its "
        "tokens' logprobs (null for the first).",
    )


# -- chat messages -------------------------------------------------------------------------------
class TextPart(_Body):
    type: Literal["text"]
    text: str = ""


def _only_text(value: Any) -> Any:
    if not isinstance(value, dict) or value.get("type") != "text":
        raise ValueError("only text content is supported")
    return value


Content = (
    str
    | list[
        Annotated[
            TextPart, BeforeValidator(_only_text), WithJsonSchema(TextPart.model_json_schema())
        ]
    ]
)


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] | None = Field(
        None, description="A JSON object, or its JSON text (as OpenAI sends it)."
    )

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, value: Any) -> Any:
        parsed = value
        if isinstance(value, str) and value.strip():
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError("must be a JSON object (or its JSON text)")
        return value


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class SystemMessage(_Body):
    role: Literal["system"]
    content: Content


class UserMessage(_Body):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Body):
    """Its content may be null or left out when it carries ``tool_calls``."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            ]
        }
    )
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None
    content: Content | None = Field(None, validate_default=True)

    @field_validator("content", mode="after")
    @classmethod
    def _content_or_calls(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("tool_calls") is None:
            # "missing": the field a client left out or sent as null is named all the same.
            raise PydanticCustomError(
                "missing", "is required and may not be null in a message without tool_calls"
            )
        return value


class ToolMessage(_Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = Field(None, description="The call this message answers.")


_ROLES = ("system", "user", "assistant", "tool")


class OtherMessage(_Body):
    """A message of another role (``developer``, ...), passed to the chat template."""

    role: Annotated[str, WithJsonSchema({"type": "string", "not": {"enum": list(_ROLES)}})]
    content: Content


def _role(message: Any) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    return f"role:{role}" if role in _ROLES else "role:other"


Message = Annotated[
    Annotated[SystemMessage, Tag("role:system")]
    | Annotated[UserMessage, Tag("role:user")]
    | Annotated[AssistantMessage, Tag("role:assistant")]
    | Annotated[ToolMessage, Tag("role:tool")]
    | Annotated[OtherMessage, Tag("role:other")],
    Discriminator(_role),
]


# -- tools ---------------------------------------------------------------------------------------
class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema.")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(OpenAIRequest):
    model_config = ConfigDict(
        # top_logprobs > 0 needs logprobs: true.
        json_schema_extra={
            "anyOf": [
                {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                {"properties": {"top_logprobs": {"enum": [0, None]}}},
            ]
        }
    )
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(
        None, min_length=1, description="Function tools; names are unique."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="required and a named function need tools, and the function must be one "
        "of them; default: auto with tools, none without.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (default true)."
    )
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="Needs logprobs: true when > 0.")


# -- SGLang's /generate --------------------------------------------------------------------------
class SamplingParams(_Body):
    """SGLang's ``sampling_params``: an unknown key is refused."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "not": {
                "description": "seed and sampling_seed together",
                "required": ["seed", "sampling_seed"],
                "properties": {"seed": {"type": "integer"}, "sampling_seed": {"type": "integer"}},
            }
        },
    )
    max_new_tokens: MaxTokens = None
    temperature: _real(ge=0) = None
    top_p: _real(gt=0, le=1) = None
    top_k: TopK = None
    min_p: _real(ge=0, le=1) = None
    repetition_penalty: _real(gt=0) = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = None
    skip_special_tokens: bool = None
    seed: _int(INT_LOW, INT_HIGH) | None = None
    sampling_seed: _int(INT_LOW, INT_HIGH) | None = Field(None, description="Alias of seed.")
    n: _int(1, 1) = None
    regex: str | None = Field(None, description=_REGEX)
    ebnf: str | None = Field(None, description=_EBNF)
    json_schema: str | None = Field(None, description=_JSON_SCHEMA)
    structural_tag: str | None = Field(None, description=_STRUCTURAL_TAG)


class GenerateRequest(_Body):
    """SGLang's native request: exactly one of text and input_ids (null is absent)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
            ]
        }
    )
    text: Annotated[str, Field(min_length=1)] | None = None
    input_ids: TokenIds | None = None
    sampling_params: SamplingParams | None = None
    stream: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: TopLogprobs | None = Field(
        None, description="Alternatives per token, at most 20 as in OpenAI's API."
    )
    rid: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="Request id, for aborts."
    )
    logprob_start_len: _int(-1, INT_HIGH) | None = Field(
        None,
        description="With return_logprob: the prompt position from which the prompt's "
        "logprobs come back (input_token_logprobs); below the prompt's length. -1 (the "
        "default): none.",
    )
    return_text_in_logprobs: bool | None = Field(
        None, description="Each logprob entry's third element is its token's text."
    )


# -- use -----------------------------------------------------------------------------------------
def validate(model: type[M], body: dict[str, Any], at: str | None = None) -> M:
    """``body`` as ``model``, or an ``APIError`` naming the bad field; ``at``: the field
    of the request that ``body`` is (``sampling_params``), which leads the names."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        if at is None:
            raise from_validation(errors, body) from None
        moved = [{**error, "loc": (at, *error["loc"])} for error in errors]
        raise from_validation(moved, {at: body}) from None
