"""Tool calls on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice``, the
grammar that makes a required call happen, and the parsers that find calls in the text.

Two output formats, under SGLang's ``--tool-call-parser`` names: ``llama3`` (Llama
3.1-3.3's JSON) and ``qwen25`` (Qwen 2.5/3's and Hermes's ``<tool_call>`` tags).
``required`` and a named function are enforced by a grammar; ``auto`` leaves the text
free and parses calls out of it. A candidate that does not parse, or names no given
tool, stays text. Calls stream as OpenAI streams them (``CallStream``). See
docs/guides/structured-outputs.md.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.server.errors import APIError

# The output formats, under SGLang's ``--tool-call-parser`` names:
# - ``llama3``: Llama 3.1-3.3's JSON, ``{"name": ..., "parameters": {...}}`` (also
#   ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``.
#   A call is recognised only where the output starts with one (or at the tag).
# - ``qwen25``: Qwen 2.5/3's (and Hermes's) tags around JSON,
#   ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, anywhere in the text.
FORMATS = ("llama3", "qwen25")
TOOL_CHOICES = ("none", "auto", "required")
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallHead:
    """The start of a call in a stream of pieces: its name and id."""

    name: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class ArgsPart:
    """A fragment of the arguments of the call last started."""

    text: str


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request with tools needs, from prompt to response.

    ``template_tools``: the tools as the chat template receives them; ``grammar``: the
    sampling params that constrain the output (``{}`` for none); ``mode``: ``auto``,
    ``required`` or ``function`` (the one ``function`` to call)."""

    format: str
    tools: tuple[Tool, ...]
    template_tools: list[dict[str, Any]]
    mode: str
    function: str | None
    parallel: bool
    grammar: dict[str, str]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def stream(self) -> CallStream:
        """A parser for one choice's text."""
        if self.format == "qwen25":
            return QwenStream(self.names)
        return Llama3Stream(self.names, forced=self.mode != "auto")


# -- the request -------------------------------------------------------------------------------
def plan(body: Mapping[str, Any], fmt: str) -> ToolPlan | None:
    """The tool plan of a chat body (``None``: no tools, or ``tool_choice`` none), or a
    400 naming what is malformed."""
    tools, template_tools = parse_tools(body.get("tools"))
    mode, name = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if not tools or mode == "none":
        return None
    many = parallel is not False
    return ToolPlan(
        fmt, tuple(tools), template_tools, mode, name, many,
        grammar(fmt, tools, mode, name, many),
    )  # fmt: skip


def parse_tools(value: Any) -> tuple[list[Tool], list[dict[str, Any]]]:
    """The tools, and their OpenAI form for the chat template (as sent, with the empty
    object schema for a function without ``parameters``); ``[]`` when absent."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise APIError("tools must be a list of function tools", param="tools")
    if not value:
        raise APIError("tools must not be empty; leave it out for no tools", param="tools")
    tools: list[Tool] = []
    shown: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object", param=where)
        if item.get("type") != "function":
            raise APIError(
                f'{where}.type must be "function" (only function tools are supported)',
                param=f"{where}.type",
            )
        function = item.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        if any(t.name == name for t in tools):
            raise APIError(
                f"{where}.function.name: {name[:64]!r} is given twice",
                param=f"{where}.function.name",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(
                f"{where}.function.description must be a string",
                param=f"{where}.function.description",
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(
                f"{where}.function.strict must be a boolean", param=f"{where}.function.strict"
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _EMPTY_PARAMETERS
        elif not isinstance(parameters, dict):
            raise APIError(
                f"{where}.function.parameters must be a JSON object (a JSON Schema)",
                param=f"{where}.function.parameters",
            )
        tools.append(Tool(name, parameters))
        shown.append({"type": "function", "function": {**function, "parameters": parameters}})
    return tools, shown


def parse_tool_choice(value: Any, tools: list[Tool]) -> tuple[str, str | None]:
    """``(mode, name)``: mode ``none``, ``auto``, ``required`` or ``function``, with the
    one function's name for the last."""
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise APIError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}; got {value[:60]!r}',
                param="tool_choice",
            )
        if value == "required" and not tools:
            raise APIError("tool_choice required needs tools", param="tool_choice")
        return value, None
    if not isinstance(value, dict):
        raise APIError("tool_choice must be a string or an object", param="tool_choice")
    if value.get("type") != "function":
        raise APIError(
            'tool_choice.type must be "function" (the one form of a named choice supported)',
            param="tool_choice.type",
        )
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            "tool_choice.function.name must be a string", param="tool_choice.function.name"
        )
    if not any(t.name == name for t in tools):
        raise APIError(
            f"tool_choice names the function {name[:64]!r}, which is not in tools",
            param="tool_choice.function.name",
        )
    return "function", name


def chosen_tools(tools: list[Tool], mode: str, name: str | None) -> list[Tool] | None:
    """The tools a call must come from: all for ``required``, one for ``function``,
    ``None`` for ``auto`` and ``none`` (no call is forced)."""
    if mode == "required":
        return tools
    if mode == "function":
        return [t for t in tools if t.name == name]
    return None


# -- grammars ----------------------------------------------------------------------------------
def grammar(
    fmt: str, tools: list[Tool], mode: str, name: str | None, parallel: bool
) -> dict[str, str]:
    """The sampling params that enforce the tool choice ``mode`` (``name``) in ``fmt``.

    ``required`` and a named function: for ``llama3`` the JSON schema of the call object,
    for ``qwen25`` xgrammar's structural tag (the tags are produced too). ``auto`` leaves
    the text free; for ``qwen25`` a structural tag triggered by ``<tool_call>`` still makes
    each call's JSON match its tool."""
    forced = chosen_tools(tools, mode, name)
    if fmt == "llama3":
        if forced is None:
            return {}
        schemas = [llama3_call_schema(t) for t in forced]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return {"json_schema": json.dumps(schema)}
    tags = [qwen_tag(t) for t in (forced or tools)]
    if forced is None:
        fmt_obj: dict[str, Any] = {
            "type": "triggered_tags", "triggers": [QWEN_OPEN], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel,
        }  # fmt: skip
    elif len(tags) == 1 and (mode == "function" or not parallel):
        fmt_obj = tags[0]
    else:
        fmt_obj = {
            "type": "tags_with_separator", "tags": tags, "separator": "\n",
            "at_least_one": True, "stop_after_first": not parallel,
        }  # fmt: skip
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt_obj})}


def llama3_call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of one Llama 3 call of ``tool``."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def qwen_tag(tool: Tool) -> dict[str, Any]:
    """xgrammar's tag of one Qwen call of ``tool``: the name is fixed text, the arguments
    match the tool's schema."""
    return {
        "type": "tag",
        "begin": f'{QWEN_OPEN}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": tool.parameters},
        "end": f"}}\n{QWEN_CLOSE}",
    }


# -- the format's default ----------------------------------------------------------------------
def default_format(template: str | None, architecture: str | None) -> tuple[str, str]:
    """The tool-call format of a model without ``--tool-call-parser``, and why: the chat
    template's own tool syntax first, then the architecture, then the template family."""
    text = template or ""
    if QWEN_OPEN in text:
        return "qwen25", "its chat template writes <tool_call> tags"
    if PYTHON_TAG in text:
        return "llama3", "its chat template has Llama 3's <|python_tag|>"
    arch = (architecture or "").lower()
    if arch.startswith("qwen"):
        return "qwen25", f"its architecture is {architecture}"
    if "<|im_start|>" in text:
        return "qwen25", "its chat template is ChatML, whose tool-calling models use <tool_call>"
    return "llama3", "no sign of another format (the fallback)"


# -- the output --------------------------------------------------------------------------------
Piece = str | CallHead | ArgsPart


def call_of(obj: Any, names: frozenset[str]) -> ToolCall | None:
    """A call from a decoded JSON object: a known ``name`` and an object of arguments
    under ``arguments`` or ``parameters`` (or that object as JSON text)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class _Out:
    """The pieces of a choice so far. Whitespace next to a call is dropped: text that
    ends in whitespace holds it back until more text follows, and a call throws it away.
    A whole call is its head and its arguments in one part."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.held = ""
        self.calls = 0
        self.after_call = False

    def text(self, s: str) -> None:
        if self.after_call:
            s = s.lstrip()
        if not s:
            return
        self.after_call = False
        s = self.held + s
        body = s.rstrip()
        self.held = s[len(body) :]
        if body:
            self.pieces.append(body)

    def call(self, c: ToolCall) -> None:
        self.head(CallHead(c.name, c.id))
        self.args(c.arguments)

    def head(self, h: CallHead) -> None:
        self.held = ""
        self.after_call = True
        self.calls += 1
        self.pieces.append(h)

    def args(self, text: str) -> None:
        if text:
            self.pieces.append(ArgsPart(text))

    def end(self) -> None:
        if not self.calls and self.held:
            self.pieces.append(self.held)
        self.held = ""

    def take(self) -> list[Piece]:
        out, self.pieces = self.pieces, []
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (and could become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _ObjectEnd:
    """Finds where a JSON object that starts a text ends, fed piece by piece: counts
    braces and brackets outside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the object (all, until its end)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def _head(pattern: re.Pattern[str], text: str, names: frozenset[str]) -> re.Match[str] | None:
    """The match of a call's start (up to its arguments' ``{``) naming a given tool."""
    match = pattern.match(text)
    if match is None:
        return None
    try:
        name = json.loads(match.group("name"))
    except ValueError:
        return None
    return match if name in names else None


_NAME = r'"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")'
_QWEN_HEAD = re.compile(r"\s*\{\s*" + _NAME + r'\s*,\s*"arguments"\s*:\s*(?=\{)')
_LLAMA_HEAD = re.compile(
    r"\s*(?:<\|python_tag\|>)?\s*\{\s*" + _NAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'
)


class CallStream:
    """One choice's text in, text pieces and calls (a head, then argument parts) out, in
    order. ``feed`` as the text arrives, ``finish`` at the end; a whole text fed at once
    gives the same calls.

    A call is streamed as OpenAI streams one: its name (``CallHead``) as soon as it is
    known, then its arguments in fragments as they are generated (``ArgsPart``), where the
    output cannot turn out not to be a call after all (a qwen25 call of a given tool whose
    arguments are an object; a llama3 call the grammar forces); other calls come whole when
    they are complete."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.out = _Out()
        self.buf = ""

    @property
    def calls(self) -> int:
        return self.out.calls

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole text as ``content`` (``None``: only calls) and its calls."""
        pieces = self.feed(text) + self.finish()
        calls = assemble(pieces)
        content = "".join(p for p in pieces if isinstance(p, str))
        return (content or None) if calls else content, calls


def assemble(pieces: list[Piece]) -> list[ToolCall]:
    """The calls of a stream's pieces, each with its arguments joined."""
    calls: list[ToolCall] = []
    for piece in pieces:
        if isinstance(piece, CallHead):
            calls.append(ToolCall(piece.name, "", piece.id))
        elif isinstance(piece, ArgsPart):
            last = calls[-1]
            calls[-1] = ToolCall(last.name, last.arguments + piece.text, last.id)
    return calls


class QwenStream(CallStream):
    """``<tool_call>...</tool_call>`` anywhere; a tail that may begin the tag is held."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.inside = False
        self.args: _ObjectEnd | None = None  # the streamed call's arguments, if streaming

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        while True:
            if not self.inside:
                at = self.buf.find(QWEN_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buf, QWEN_OPEN)
                    self.out.text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                self.out.text(self.buf[:at])
                self.buf = self.buf[at + len(QWEN_OPEN) :]
                self.inside = True
            elif self.args is not None:
                if not self._stream_args():
                    break
            else:
                head = _head(_QWEN_HEAD, self.buf, self.names)
                if head is not None:
                    self.out.head(CallHead(json.loads(head.group("name"))))
                    self.buf = self.buf[head.end() :]
                    self.args = _ObjectEnd()
                    continue
                at = self.buf.find(QWEN_CLOSE)
                if at < 0:
                    break
                inner = self.buf[:at]
                self.buf = self.buf[at + len(QWEN_CLOSE) :]
                self.inside = False
                call = _json_call(inner, self.names)
                if call is None:
                    self.out.text(QWEN_OPEN + inner + QWEN_CLOSE)
                else:
                    self.out.call(call)
        return self.out.take()

    def _stream_args(self) -> bool:
        """Pass the streamed call's arguments on; at their end, skip to the closing tag.
        Whether the call is over (else more text is needed)."""
        assert self.args is not None
        if not self.args.done:
            used = self.args.feed(self.buf)
            self.out.args(self.buf[:used])
            self.buf = self.buf[used:]
            if not self.args.done:
                return False
        at = self.buf.find(QWEN_CLOSE)
        if at < 0:
            return False
        self.buf = self.buf[at + len(QWEN_CLOSE) :]
        self.inside, self.args = False, None
        return True

    def finish(self) -> list[Piece]:
        # An unclosed call (cut by max_tokens) stays text, unless it was being
        # streamed: then it ends where the text did.
        if self.args is None:
            self.out.text((QWEN_OPEN if self.inside else "") + self.buf)
        self.buf, self.inside, self.args = "", False, None
        self.out.end()
        return self.out.take()


def _json_call(text: str, names: frozenset[str]) -> ToolCall | None:
    # strict=False: a raw control character inside a string is read, then escaped when
    # the arguments are written again, rather than losing the call.
    try:
        obj = json.loads(text, strict=False)
    except ValueError:
        return None
    return call_of(obj, names)


class Llama3Stream(CallStream):
    """Calls where the output starts with ``{`` (after whitespace) or at ``<|python_tag|>``,
    to the end of the output: held until the end, then parsed; text when they do not parse."""

    def __init__(self, names: frozenset[str], forced: bool = False) -> None:
        super().__init__(names)
        self.state = "start"  # then "text", "calls", or "streaming" (a forced call)
        self.tagged = False
        self.forced = forced
        self.args: _ObjectEnd | None = None

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        if self.forced and self.state in ("start", "streaming"):
            return self._stream_forced()
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            if head.startswith("{"):
                self.state = "calls"
            else:
                self.state = "text"
        if self.state == "text":
            at = self.buf.find(PYTHON_TAG)
            if at >= 0:
                self.out.text(self.buf[:at])
                self.buf = self.buf[at + len(PYTHON_TAG) :]
                self.state, self.tagged = "calls", True
            else:
                keep = _partial_suffix(self.buf, PYTHON_TAG)
                self.out.text(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
        return self.out.take()

    def _stream_forced(self) -> list[Piece]:
        """The grammar makes the whole output one call object, name first: its name as
        soon as it is there, then its arguments as they come."""
        if self.args is None:
            head = _head(_LLAMA_HEAD, self.buf, self.names)
            if head is None:
                return []  # not yet (or not in this form: parsed whole at the end)
            self.out.head(CallHead(json.loads(head.group("name"))))
            self.buf = self.buf[head.end() :]
            self.state, self.args = "streaming", _ObjectEnd()
        if not self.args.done:
            used = self.args.feed(self.buf)
            self.out.args(self.buf[:used])
            self.buf = self.buf[used:]
        return self.out.take()

    def finish(self) -> list[Piece]:
        if self.state == "streaming":
            self.buf, self.state, self.args = "", "start", None
            self.out.end()
            return self.out.take()
        if self.state == "calls" or (self.state == "start" and self.buf.lstrip()):
            region = self.buf.lstrip()
            if region.startswith(PYTHON_TAG):
                region, self.tagged = region[len(PYTHON_TAG) :], True
            calls = llama3_calls(region, self.names)
            if calls is None:
                self.out.text((PYTHON_TAG if self.tagged else "") + region)
            else:
                for call in calls:
                    self.out.call(call)
        else:
            self.out.text(self.buf)
        self.buf, self.state = "", "start"
        self.out.end()
        return self.out.take()


_SEPARATORS = re.compile(r"[\s;]*")


def llama3_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """JSON call objects separated by ``;`` or whitespace, or ``None`` unless the whole
    text is such calls."""
    decoder = json.JSONDecoder(strict=False)
    calls: list[ToolCall] = []
    pos = 0
    while True:
        sep = _SEPARATORS.match(text, pos)
        pos = sep.end() if sep else pos
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_of(obj, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None
