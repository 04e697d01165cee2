"""The request models (``tandem.server.request_models``): what the schema of ``/openapi.json``
says of chat messages and tool calls, that such bodies are taken, and that a validation
error names the field the client sent. No engine: the models and the schema only."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from tandem.server import openapi_schemas, request_models
from tandem.server.errors import APIError, param_of

CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "1 + 2?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "3"},
    {"role": "developer", "content": "any other role takes text"},
]


def _chat_schema() -> dict[str, Any]:
    extra = openapi_schemas.openai_body(request_models.ChatCompletionRequest, "tiny")
    return extra["requestBody"]["content"]["application/json"]["schema"]  # type: ignore[no-any-return]


def test_the_schema_describes_tool_messages_and_tool_calls() -> None:
    schema = _chat_schema()
    members = schema["properties"]["messages"]["items"]["oneOf"]
    by_role = {str(m["properties"]["role"].get("const")): m for m in members}
    assert {"system", "user", "assistant", "tool"} <= set(by_role)
    assistant = by_role["assistant"]["properties"]
    call = assistant["tool_calls"]["anyOf"][0]["items"]
    assert set(call["properties"]["function"]["properties"]) == {"name", "arguments"}
    assert "tool_call_id" in by_role["tool"]["properties"]
    assert "$ref" not in str(schema)  # self-contained


def test_a_tool_conversation_is_valid_and_taken() -> None:
    body = {"messages": CONVERSATION, "tools": [{"type": "function", "function": {"name": "add"}}]}
    assert jsonschema_rs.Draft202012Validator(_chat_schema()).is_valid(body)
    chat = request_models.validate(request_models.ChatCompletionRequest, body)
    assert [type(m).__name__ for m in chat.messages] == [
        "SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage", "OtherMessage",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
         "messages[0].content[0].text"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
          "arguments": "[1]"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"messages": CONVERSATION, "max_tokens": "5"}, "max_tokens"),
        ({"messages": CONVERSATION, "stream": 1}, "stream"),
        ({"messages": CONVERSATION, "stop": ["a", 5]}, "stop[1]"),
        ({"messages": CONVERSATION, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": CONVERSATION, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage"),
    ],
)  # fmt: skip
def test_a_validation_error_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        request_models.validate(request_models.ChatCompletionRequest, body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert info.value.message.startswith(param)


def test_sampling_params_are_named_under_their_field() -> None:
    body = {"text": "hi", "sampling_params": {"temperature": "hot", "top_k": 2}}
    with pytest.raises(APIError) as info:
        request_models.validate(request_models.GenerateRequest, body)
    assert info.value.param == "sampling_params.temperature"
    with pytest.raises(APIError) as info:
        request_models.validate(
            request_models.GenerateRequest, {"text": "hi", "sampling_params": {"x": 1}}
        )
    assert info.value.param == "sampling_params.x"


def test_integral_numbers_are_integers_and_extra_fields_are_ignored() -> None:
    body = {"prompt": [1, 2], "max_tokens": 3.0, "n": 2.0, "logit_bias": {"5": 1}}
    completion = request_models.validate(request_models.CompletionRequest, body)
    assert (completion.max_tokens, completion.n) == (3, 2)
    with pytest.raises(APIError) as info:
        request_models.validate(request_models.CompletionRequest, {**body, "max_tokens": 3.5})
    assert info.value.param == "max_tokens"


def test_param_of_skips_union_labels() -> None:
    body = {"messages": [{"role": "user", "content": None}]}
    loc = ("messages", 0, "role:user", "content", "str")
    assert param_of(loc, body) == "messages[0].content"
    assert param_of(("messages", 0, "role:user", "name"), body, missing=True) == "messages[0].name"
    assert param_of((), body) is None
