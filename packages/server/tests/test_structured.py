"""Structured outputs and tool calls: ``response_format``, SGLang's grammar fields,
``tools`` and ``tool_choice``.

The first half needs no engine: how each API input maps onto the sampling params the
server schedules, what it refuses, the grammars it builds (checked with xgrammar), and
the tool-call parsers. The second half drives a live ``tandem serve`` (the tiny test
model, whose random weights emit gibberish unless a grammar holds them) with the
official ``openai`` client: the outputs must parse and match their schemas.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import openai
import pydantic
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server

from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.models.tiny import SPECIAL_TOKENS, build_default_tokenizer
from tandem.scheduler.text.tokenizer import SpecialTokens, Tokenizer
from tandem.server import app as app_module
from tandem.server import parsing, structured, tool_calls
from tandem.server.app import ServerState
from tandem.server.errors import APIError
from tandem.server.generation import Choice
from tandem.server.routes import native as native_routes
from tandem.server.routes import openai as openai_routes
from tandem.server.routes.openai import _full_choice, _tool_deltas
from tandem.server.server_config import ServerConfig
from tandem.server.tool_calls import Tool

TIMEOUT = 120
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(pydantic.BaseModel):
    """Small enough for a model that writes random tokens: enums, bounded numbers and
    strings, so the grammar ends the JSON well within the token budget."""

    city: Literal["Paris", "Tokyo", "Lima"]
    days: Annotated[int, pydantic.Field(ge=1, le=7)]
    unit: Literal["celsius", "fahrenheit"]


class Sum(pydantic.BaseModel):
    a: Annotated[int, pydantic.Field(ge=0, le=99)]
    b: Annotated[int, pydantic.Field(ge=0, le=99)]


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="get_weather")
SUM_TOOL = openai.pydantic_function_tool(Sum, name="add")
TOOLS = [WEATHER_TOOL, SUM_TOOL]
MODELS = {"get_weather": Weather, "add": Sum}
WEATHER_SCHEMA = WEATHER_TOOL["function"]["parameters"]


def _tools() -> list[Tool]:
    return tool_calls.parse_tools(TOOLS)[0]


# -- response_format and the grammar fields ----------------------------------------------------
@pytest.mark.parametrize(
    ("body", "params"),
    [
        ({}, {}),
        ({"response_format": None}, {}),
        ({"response_format": {"type": "text"}}, {}),
        ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER_SCHEMA, "strict": True},
                }
            },
            {"json_schema": json.dumps(WEATHER_SCHEMA)},
        ),
        ({"regex": "[ab]+"}, {"regex": "[ab]+"}),
        ({"ebnf": 'root ::= "x"'}, {"ebnf": 'root ::= "x"'}),
        ({"json_schema": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
        ({"json_schema": {"type": "string"}}, {"json_schema": '{"type": "string"}'}),
        (
            {"response_format": {"type": "text"}, "regex": "a"},
            {"regex": "a"},
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},
            {"structural_tag": '{"type": "structural_tag", "format": {"type": "any_text"}}'},
        ),
    ],
)
def test_openai_bodies_map_onto_one_grammar(body: dict[str, Any], params: dict[str, str]) -> None:
    assert structured.openai_grammar(body) == params


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": {}}, "response_format.type", "must be one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "is required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": []},
                }
            },
            "response_format.json_schema.schema",
            "JSON object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "non-empty string",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
            "boolean",
        ),
        (
            {"response_format": {"type": "json_object", "schema": {"type": "object"}}},
            "response_format.type",
            "both a schema and type json_object",
        ),
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
            "response_format.type",
            "both a schema and type json_object",
        ),
        (
            {"response_format": {"type": "json_object"}, "regex": "a+"},
            "regex",
            "cannot be combined",
        ),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "only one of"),
        ({"regex": 5}, "regex", "must be a string"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "format"),
    ],
)
def test_bad_response_formats_are_refused(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as info:
        structured.openai_grammar(body)
    assert info.value.status == 400
    assert info.value.param == param
    assert words in info.value.message, info.value.message


LIMITS = parsing.Limits(100, 64)


def test_generate_takes_sglangs_grammar_fields() -> None:
    for kind in ("regex", "json_schema", "ebnf", "structural_tag"):
        params = parsing.native_sampling({kind: "x", "max_new_tokens": 4})
        assert params[kind] == "x"
        checked = parsing.validate(params, 3, LIMITS, "sampling_params.")
        assert checked[kind] == "x"
    with pytest.raises(APIError) as info:
        parsing.validate(
            parsing.native_sampling({"regex": "a", "json_schema": "{}", "max_new_tokens": 4}), 3,
            LIMITS, "sampling_params.",
        )  # fmt: skip
    assert info.value.param == "sampling_params.regex"
    with pytest.raises(APIError) as info:
        parsing.validate({"regex": 5, "max_new_tokens": 4}, 3, LIMITS, "sampling_params.")
    assert info.value.param == "sampling_params.regex"


# -- tools and tool_choice ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": {"x": 1}}, "tools", "list"),
        ({"tools": []}, "tools", "not be empty"),
        ({"tools": ["f"]}, "tools[0]", "object"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "function"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "object"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "string"),
        (
            {"tools": [WEATHER_TOOL, WEATHER_TOOL]},
            "tools[1].function.name",
            "'get_weather' is given twice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
            "JSON object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
            "tools[0].function.strict",
            "boolean",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'always'"),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", "string or an object"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.type", "function"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "string",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice.function.name",
            "'fly', which is not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice.function.name",
            "not in tools",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_tools_are_refused(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as info:
        tool_calls.plan(body, "qwen25")
    assert info.value.status == 400
    assert info.value.param == param
    assert words in info.value.message, info.value.message


def test_tool_choice_modes() -> None:
    tools = _tools()
    assert tool_calls.plan({}, "qwen25") is None
    assert tool_calls.plan({"tool_choice": "none"}, "qwen25") is None
    assert tool_calls.plan({"tool_choice": "auto"}, "llama3") is None
    assert tool_calls.plan({"tools": TOOLS, "tool_choice": "none"}, "qwen25") is None
    auto = tool_calls.plan({"tools": TOOLS}, "llama3")
    assert auto is not None
    assert (auto.mode, auto.function, auto.parallel, auto.grammar) == ("auto", None, True, {})
    assert auto.tools == tuple(tools)
    assert auto.template_tools == TOOLS
    named = tool_calls.plan(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
        "llama3",
    )
    assert named is not None
    assert (named.mode, named.function) == ("function", "add")
    assert json.loads(named.grammar["json_schema"]) == tool_calls.llama3_call_schema(tools[1])
    required = tool_calls.plan(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, "llama3"
    )
    assert required is not None
    assert not required.parallel
    assert json.loads(required.grammar["json_schema"]) == {
        "anyOf": [tool_calls.llama3_call_schema(t) for t in tools]
    }
    # A tool without parameters takes none.
    bare = tool_calls.parse_tools([{"type": "function", "function": {"name": "now"}}])[0]
    assert bare == [Tool("now", {"type": "object", "properties": {}})]


def _grammar(params: dict[str, str]) -> xgrammar.Grammar:
    ((kind, text),) = params.items()
    if kind == "structural_tag":
        return xgrammar.Grammar.from_structural_tag(text)
    assert kind == "json_schema"
    return xgrammar.Grammar.from_json_schema(text)


QWEN_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2, "unit": "celsius"}}\n</tool_call>'  # noqa: E501
QWEN_SUM = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
LLAMA_WEATHER = (
    '{"name": "get_weather", "parameters": {"city": "Lima", "days": 2, "unit": "celsius"}}'
)
LLAMA_SUM = '{"name": "add", "parameters": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(
    ("fmt", "mode", "name", "parallel", "accepted", "refused"),
    [
        ("qwen25", "function", "add", True, [QWEN_SUM], [QWEN_WEATHER, "hi", "", QWEN_SUM * 2]),
        (
            "qwen25", "required", None, True,
            [QWEN_SUM, QWEN_WEATHER, f"{QWEN_SUM}\n{QWEN_WEATHER}"],
            ["", "hi", f"hi {QWEN_SUM}", QWEN_SUM.replace('"b": 2', '"b": 200')],
        ),
        (
            "qwen25", "required", None, False,
            [QWEN_SUM, QWEN_WEATHER], [f"{QWEN_SUM}\n{QWEN_WEATHER}", ""],
        ),
        (
            "qwen25", "auto", None, True,
            ["", "Hello!", f"Let me see. {QWEN_SUM}", f"{QWEN_SUM}\n{QWEN_WEATHER} done"],
            [QWEN_SUM.replace('"a": 1, ', ""), '<tool_call>\n{"name": "fly"}\n</tool_call>'],
        ),
        ("llama3", "function", "add", True, [LLAMA_SUM], [LLAMA_WEATHER, "hi"]),
        (
            "llama3", "required", None, True,
            [LLAMA_SUM, LLAMA_WEATHER], ["hi", LLAMA_SUM.replace('"a": 1', '"a": "1"')],
        ),
    ],
)  # fmt: skip
def test_tool_grammars_force_the_calls(
    fmt: str,
    mode: str,
    name: str | None,
    parallel: bool,
    accepted: list[str],
    refused: list[str],
) -> None:
    params = tool_calls.grammar(fmt, _tools(), mode, name, parallel)
    grammar = _grammar(params)
    for text in accepted:
        assert _is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not _is_grammar_accept_string(grammar, text), text
    assert tool_calls.grammar("llama3", _tools(), "auto", None, True) == {}


def test_json_object_grammar_compiles() -> None:
    grammar = _grammar(structured.response_format({"type": "json_object"}))
    assert _is_grammar_accept_string(grammar, '{"a": [1, 2]}')
    assert not _is_grammar_accept_string(grammar, "[1]")


# -- the parsers -------------------------------------------------------------------------------
NAMES = frozenset({"get_weather", "add"})
SUM_ARGS = '{"a": 1, "b": 2}'


def _stream(fmt: str) -> tool_calls.CallStream:
    return tool_calls.QwenStream(NAMES) if fmt == "qwen25" else tool_calls.Llama3Stream(NAMES)


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        ("qwen25", QWEN_SUM, None, [("add", SUM_ARGS)]),
        (
            "qwen25",
            f"Let me add.\n{QWEN_SUM}\n{QWEN_WEATHER}\n",
            "Let me add.",
            [("add", SUM_ARGS), ("get_weather", '{"city": "Lima", "days": 2, "unit": "celsius"}')],
        ),
        ("qwen25", f"{QWEN_SUM}\nDone.", "Done.", [("add", SUM_ARGS)]),
        ("qwen25", "Just text <b>bold</b>  ", "Just text <b>bold</b>  ", []),
        (
            "qwen25",
            "<tool_call>\n{not json}\n</tool_call>",
            "<tool_call>\n{not json}\n</tool_call>",
            [],
        ),
        (
            "qwen25",
            '<tool_call>{"name": "fly", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "fly", "arguments": {}}</tool_call>',
            [],
        ),
        ("qwen25", QWEN_SUM[:30], QWEN_SUM[:30], []),  # cut by max_tokens
        ("qwen25", "a <tool_cal", "a <tool_cal", []),
        (
            "qwen25",
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
            None,
            [("add", SUM_ARGS)],
        ),
        ("qwen25", "", "", []),
        ("llama3", LLAMA_SUM, None, [("add", SUM_ARGS)]),
        ("llama3", f"  <|python_tag|>{LLAMA_SUM}", None, [("add", SUM_ARGS)]),
        ("llama3", f"Sure. <|python_tag|>{LLAMA_SUM}", "Sure.", [("add", SUM_ARGS)]),
        (
            "llama3",
            f"{LLAMA_SUM}; {LLAMA_WEATHER}",
            None,
            [("add", SUM_ARGS), ("get_weather", '{"city": "Lima", "days": 2, "unit": "celsius"}')],
        ),
        ("llama3", '{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", SUM_ARGS)]),
        ("llama3", '{"answer": 42}', '{"answer": 42}', []),
        ("llama3", '{"name": ["add"], "arguments": {}}', '{"name": ["add"], "arguments": {}}', []),
        ("llama3", '{"name": "add", "parameters": [1]}', '{"name": "add", "parameters": [1]}', []),
        ("llama3", f"{LLAMA_SUM} and more", f"{LLAMA_SUM} and more", []),
        ("llama3", f"Text then {LLAMA_SUM}", f"Text then {LLAMA_SUM}", []),
        ("llama3", "<|py", "<|py", []),
        ("llama3", " \n", " \n", []),
    ],
)
def test_parsers(fmt: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    stream = _stream(fmt)
    got_content, got_calls = stream.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for call in got_calls:
        assert call.id.startswith("call_")
        MODELS[call.name].model_validate_json(call.arguments)
    # Streamed piece by piece, the same text comes out in the same calls.
    for size in (1, 3, 7):
        piecewise = (
            tool_calls.QwenStream(NAMES) if fmt == "qwen25" else tool_calls.Llama3Stream(NAMES)
        )
        pieces: list[tool_calls.Piece] = []
        for at in range(0, len(text), size):
            pieces += piecewise.feed(text[at : at + size])
        pieces += piecewise.finish()
        texts = "".join(p for p in pieces if isinstance(p, str))
        assert texts == (content or "")
        assert [(c.name, c.arguments) for c in tool_calls.assemble(pieces)] == calls


@pytest.mark.parametrize(
    ("stream", "text"),
    [
        (tool_calls.QwenStream(NAMES), f"Let me add. {QWEN_WEATHER}"),
        (tool_calls.Llama3Stream(NAMES, forced=True), LLAMA_WEATHER),
    ],
)
def test_a_call_streams_its_name_then_its_arguments_in_fragments(
    stream: tool_calls.CallStream, text: str
) -> None:
    """Fed a few characters at a time, a call's name comes as soon as it is complete and
    its arguments follow in fragments, long before the call ends."""
    pieces: list[tool_calls.Piece] = []
    fed_at_head = None
    for at in range(0, len(text), 4):
        pieces += stream.feed(text[at : at + 4])
        if fed_at_head is None and any(isinstance(p, tool_calls.CallHead) for p in pieces):
            fed_at_head = at + 4
    pieces += stream.finish()
    assert fed_at_head is not None
    assert fed_at_head < text.index('"city"') + 4  # the name, before the arguments
    parts = [p.text for p in pieces if isinstance(p, tool_calls.ArgsPart)]
    assert len(parts) > 5
    assert "".join(parts) == '{"city": "Lima", "days": 2, "unit": "celsius"}'
    [call] = tool_calls.assemble(pieces)
    assert call.name == "get_weather"


def test_an_auto_llama3_call_is_held_until_it_is_known_to_be_one() -> None:
    """Without a grammar, text after the object makes it no call: nothing is streamed
    as a call before the end."""
    stream = tool_calls.Llama3Stream(NAMES)
    assert stream.feed(LLAMA_SUM) == []
    assert stream.feed(" and more") == []
    assert stream.finish() == [f"{LLAMA_SUM} and more"]


def test_raw_control_characters_in_a_call_are_escaped() -> None:
    """Arguments sent as a JSON string whose text holds a raw control character (here
    a tab) are still read as a call, and given back as valid JSON."""
    inner = json.dumps({"name": "get_weather", "arguments": '{"city": "Li\tma"}'})
    content, calls = tool_calls.QwenStream(NAMES).parse(f"<tool_call>\n{inner}\n</tool_call>")
    assert content is None
    assert json.loads(calls[0].arguments) == {"city": "Li\tma"}


def test_text_is_not_held_back_longer_than_needed() -> None:
    stream = tool_calls.QwenStream(NAMES)
    assert stream.feed("Hello <tool") == ["Hello"]
    assert stream.feed("box> and") == [" <toolbox> and"]
    llama = tool_calls.Llama3Stream(NAMES)
    assert llama.feed("  ") == []
    assert llama.feed("Hi") == ["  Hi"]
    assert llama.feed(" {") == [" {"]


@pytest.mark.parametrize(
    ("template", "architecture", "fmt"),
    [
        ("{% if tools %}<tool_call>{% endif %}<|im_start|>", "Qwen2ForCausalLM", "qwen25"),
        ("<|python_tag|>{{ messages }}", "LlamaForCausalLM", "llama3"),
        ("<|start_header_id|>", "Qwen3ForCausalLM", "qwen25"),
        ("<|im_start|>{{ m }}<|im_end|>", "LlamaForCausalLM", "qwen25"),  # the tiny model
        ("<|start_header_id|>", "LlamaForCausalLM", "llama3"),
        (None, None, "llama3"),
    ],
)
def test_default_format(template: str | None, architecture: str | None, fmt: str) -> None:
    got, why = tool_calls.default_format(template, architecture)
    assert got == fmt
    assert why


def test_the_flag_wins_and_is_checked() -> None:
    config = ServerConfig(tool_call_parser="llama3")
    config.validate()
    assert app_module.tool_format_of(config, None, {"architecture": "Qwen2ForCausalLM"}) == (
        "llama3", "--tool-call-parser",
    )  # fmt: skip
    with pytest.raises(ValueError, match="tool_call_parser must be one of llama3, qwen25"):
        ServerConfig(tool_call_parser="hermes").validate()


# -- the jobs the server schedules, without an engine -----------------------------------------
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def state() -> ServerState:
    tokenizer = Tokenizer(
        build_default_tokenizer(),
        special_tokens=SpecialTokens(bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[3]),
        chat_templates={"default": TOOLS_TEMPLATE},
    )
    limits = parsing.Limits(tokenizer.vocab_size, 2048)
    return ServerState(
        None, None, tokenizer, limits, "default", ServerConfig(), None, None, "qwen25",  # type: ignore[arg-type]
    )  # fmt: skip


def _chat(state: ServerState, **body: Any) -> tuple[list[parsing.Job], Any, str]:
    raw = json.dumps({"messages": USER, "max_tokens": 50, **body}).encode()
    _, jobs, plan = openai_routes._prepare_chat(state, raw)
    assert state.tokenizer is not None
    return jobs, plan, state.tokenizer.decode(jobs[0].prompt_ids, skip_special_tokens=False)


def test_chat_jobs_carry_the_grammar(state: ServerState) -> None:
    jobs, plan, prompt = _chat(state, response_format={"type": "json_object"}, n=2)
    assert plan is None
    assert [j.params["json_schema"] for j in jobs] == ['{"type": "object"}'] * 2
    assert "TOOLS" not in prompt
    jobs, plan, prompt = _chat(state, tools=TOOLS, tool_choice="required")
    assert plan is not None
    assert plan.mode == "required"
    assert jobs[0].params["structural_tag"] == plan.grammar["structural_tag"]
    assert jobs[0].params["json_schema"] is None
    assert prompt.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    jobs, plan, prompt = _chat(state, tools=TOOLS, tool_choice="none")
    assert plan is None
    assert jobs[0].params["structural_tag"] is None
    assert "TOOLS" not in prompt
    # auto in qwen25: calls are constrained once the model opens one.
    jobs, plan, _ = _chat(state, tools=TOOLS)
    tag = json.loads(jobs[0].params["structural_tag"])
    assert tag["format"]["type"] == "triggered_tags"
    assert tag["format"]["triggers"] == ["<tool_call>"]


def test_completion_jobs_carry_the_grammar(state: ServerState) -> None:
    raw = json.dumps(
        {"prompt": "x", "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}}
    ).encode()  # fmt: skip
    _, jobs = openai_routes._prepare_completion(state, raw)
    assert json.loads(jobs[0].params["json_schema"]) == WEATHER_SCHEMA
    raw = json.dumps({"text": "x", "sampling_params": {"regex": "[0-9]+"}}).encode()
    _, jobs = native_routes._prepare_native(state, raw)
    assert jobs[0].params["regex"] == "[0-9]+"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{"}}
            ]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_chat_refusals(state: ServerState, body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        _chat(state, **body)
    assert info.value.param == param, info.value.message


def test_a_conversation_with_tool_results(state: ServerState) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    _, plan, prompt = _chat(state, messages=messages, tools=TOOLS)
    assert plan is not None
    assert 'CALL add {"a": 1, "b": 2}' in prompt  # the arguments reach the template as an object
    assert "<|im_start|>tool\n3<|im_end|>" in prompt


JOBS = [parsing.Job(0, [1], {})]


def _delta(text: str, finish: str | None) -> Delta:
    meta = {"finish_reason": None if finish is None else {"type": finish}}
    return Delta("r", [1] * len(text), meta, text=text)


def test_streamed_deltas_reassemble_to_the_full_response(state: ServerState) -> None:
    plan = tool_calls.plan({"tools": TOOLS}, "qwen25")
    assert plan is not None
    text = f"Let me see. {QWEN_SUM}\n{QWEN_WEATHER}"
    full = _full_choice(state, Choice(0, text, finish_reason="stop"), JOBS, True, plan)
    message = full["message"]
    assert full["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me see."
    stream = plan.stream()
    chunks = []
    for at in range(0, len(text), 5):
        piece = text[at : at + 5]
        last = at + 5 >= len(text)
        chunks += _tool_deltas(state, _delta(piece, "stop" if last else None), stream)
    assert [c["finish_reason"] for c in chunks].count("tool_calls") == 1
    assert chunks[-1]["finish_reason"] == "tool_calls"
    content = "".join(c["delta"].get("content", "") for c in chunks)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in chunk["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            if "id" in delta:
                assert delta["id"].startswith("call_")
                assert delta["type"] == "function"
                call["name"] += delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    assert content == message["content"]
    assert [calls[i] for i in sorted(calls)] == [
        {k: c["function"][k] for k in ("name", "arguments")} for c in message["tool_calls"]
    ]
    cut = _full_choice(state, Choice(0, QWEN_SUM, finish_reason="length"), JOBS, True, plan)
    assert cut["finish_reason"] == "length"  # a complete call, but the budget ended the turn


# -- end to end: a live server -----------------------------------------------------------------
# Sampled with a seed rather than greedily: the random weights, argmax-decoded, can repeat
# one whitespace token for as long as the grammar allows it.
SAMPLE: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 400}


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_the_tiny_model_parses_qwen25(server: LiveServer) -> None:
    info = httpx.get(f"{server.url}/get_server_info", timeout=TIMEOUT).json()
    assert info["tool_call_parser"] == "qwen25"


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model="tandem-tiny", messages=USER, response_format=Weather, **SAMPLE
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_json_object(client: openai.OpenAI, server: LiveServer) -> None:
    chat = client.chat.completions.create(
        model="tandem-tiny", messages=USER, response_format={"type": "json_object"}, **SAMPLE
    )
    assert chat.choices[0].finish_reason == "stop", chat
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    body = {"prompt": "JSON:", "response_format": {"type": "json_object"}, **SAMPLE}
    completion = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert isinstance(json.loads(completion["choices"][0]["text"]), dict), completion


def test_json_schema_on_completions_and_streamed(server: LiveServer) -> None:
    schema = {"name": "sum", "schema": Sum.model_json_schema()}
    body = {"prompt": "1 + 2", "response_format": {"type": "json_schema", "json_schema": schema}}
    whole = httpx.post(
        f"{server.url}/v1/completions", json={**body, **SAMPLE}, timeout=TIMEOUT
    ).json()
    text = whole["choices"][0]["text"]
    Sum.model_validate_json(text)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, **SAMPLE, "stream": True},
        timeout=TIMEOUT,
    ) as response:  # fmt: skip
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(json.loads(line)["choices"][0]["text"] for line in lines) == text


@pytest.mark.parametrize(
    ("params", "check"),
    [
        ({"regex": r"(yes|no), [0-9]{1,3}!"}, r"(yes|no), [0-9]{1,3}!"),
        ({"ebnf": 'root ::= "It is " ("red" | "blue") "."'}, r"It is (red|blue)\."),
        (
            {"json_schema": json.dumps(Sum.model_json_schema())},
            r"\{.*\}",
        ),
    ],
)
def test_generate_grammars(server: LiveServer, params: dict[str, str], check: str) -> None:
    body = {
        "text": "Answer:",
        "sampling_params": {**params, "max_new_tokens": 400, "temperature": 1.0, "seed": 3},
    }
    out = httpx.post(f"{server.url}/generate", json=body, timeout=TIMEOUT).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert re.fullmatch(check, out["text"], re.DOTALL), out["text"]
    if "json_schema" in params:
        Sum.model_validate_json(out["text"])


BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}},
         "sampling_params.regex"),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= nowhere"}},
         "sampling_params.ebnf"),
        (CHAT, {"messages": USER, "regex": "[z-a]"}, "regex"),
        ("/v1/completions", {"prompt": "x", "json_schema": BAD_SCHEMA}, "json_schema"),
        (
            CHAT,
            {"messages": USER, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
            "response_format",
        ),
        (
            CHAT,
            {"messages": USER, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
            "tools",
        ),
    ],
)  # fmt: skip
def test_a_grammar_that_does_not_compile_is_a_400(
    server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    for stream in (False, True):
        response = httpx.post(
            f"{server.url}{path}", json={**body, "stream": stream}, timeout=TIMEOUT
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        assert re.match(r"request 0: (json_schema|regex|ebnf|structural_tag): ", error["message"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server: LiveServer, body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        response = httpx.post(
            f"{server.url}{CHAT}", json={"messages": USER, **body, "stream": stream},
            timeout=TIMEOUT,
        )  # fmt: skip
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def _check_calls(message: Any, names: set[str]) -> list[tuple[str, str]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name in names
        MODELS[call.function.name].model_validate_json(call.function.arguments)
        out.append((call.function.name, call.function.arguments))
    return out


def _streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str]]]:
    content = ""
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, ["", ""])
                if delta.id is not None:
                    assert delta.id.startswith("call_")
                    assert delta.type == "function"
                assert delta.function is not None
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"]
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def _tool_requests(client: openai.OpenAI) -> None:
    """tool_choice required and a named function give valid calls; a stream gives the
    same calls in deltas."""
    base = {"model": "tandem-tiny", "messages": USER, "tools": TOOLS, **SAMPLE}
    required = client.chat.completions.create(tool_choice="required", **base)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = _check_calls(choice.message, set(MODELS))
    assert not (choice.message.content or "").strip()
    assert _streamed_calls(client, tool_choice="required", **base) == ("", calls)

    named = {"type": "function", "function": {"name": "add"}}
    one = client.chat.completions.create(tool_choice=named, **base)  # type: ignore[arg-type]
    assert one.choices[0].finish_reason == "tool_calls", one
    assert [name for name, _ in _check_calls(one.choices[0].message, {"add"})] == ["add"]

    single = client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, **base
    )
    assert len(_check_calls(single.choices[0].message, set(MODELS))) == 1


def test_tool_calls_qwen25(client: openai.OpenAI) -> None:
    _tool_requests(client)


def test_parse_with_pydantic_tools(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model="tandem-tiny", messages=USER, tools=TOOLS, tool_choice="required", **SAMPLE
    )
    calls = out.choices[0].message.tool_calls or []
    assert calls
    for call in calls:
        assert isinstance(call.function.parsed_arguments, (Weather, Sum))


def test_auto_gives_text_or_valid_calls(client: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        out = client.chat.completions.create(
            model="tandem-tiny", messages=USER, tools=TOOLS, **{**SAMPLE, "seed": seed,
                                                            "max_tokens": 40},
        )  # fmt: skip
        message = out.choices[0].message
        if message.tool_calls:
            _check_calls(message, set(MODELS))
            assert out.choices[0].finish_reason in ("tool_calls", "length")
        else:
            assert isinstance(message.content, str)


@pytest.fixture(scope="module")
def llama3_server(cache: Path) -> Iterator[LiveServer]:
    with live_server(cache, "--tool-call-parser", "llama3") as live:
        yield live


def test_tool_calls_llama3(llama3_server: LiveServer) -> None:
    info = httpx.get(f"{llama3_server.url}/get_server_info", timeout=TIMEOUT).json()
    assert info["tool_call_parser"] == "llama3"
    _tool_requests(openai.OpenAI(base_url=f"{llama3_server.url}/v1", api_key="none", max_retries=0))
