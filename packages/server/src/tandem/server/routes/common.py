"""What the OpenAI routes and ``/generate`` share: the server's state, the body, the
prompt's tokens, a grammar error's field and a token's text."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tandem.server import parsing, prepare, request_models, tool_calls
from tandem.server.errors import APIError

if TYPE_CHECKING:
    from tandem.server.app import ServerState


def server_state(request: Request) -> ServerState:
    """The running server's state, which ``create_app``'s lifespan sets once the engine
    has started."""
    st: ServerState = request.app.state.tandem
    return st


def read_body(raw: bytes, model: type[request_models.M]) -> tuple[dict[str, Any], request_models.M]:
    """The raw body's JSON object, checked (``parsing.load_json``), and it as ``model``."""
    body = parsing.ensure_object(parsing.load_json(raw))
    return body, request_models.validate(model, body)


def encode(
    st: ServerState, texts: list[str], params: list[str], special: bool = True
) -> list[list[int]]:
    """Token ids of each text; ``params[i]`` names text i in errors. A text too long to
    fit in the context is refused before it is tokenized."""
    if st.tokenizer is None:
        raise APIError("this model has no tokenizer: send token ids", param=params[0])
    for text, param in zip(texts, params, strict=True):
        parsing.check_text_length(text, st.limits, param)
    return prepare.encode(st.tokenizer, texts, special)


_GRAMMAR_ERROR = re.compile(r"request \d+: (json_schema|regex|ebnf|structural_tag): ")


@contextlib.contextmanager
def grammar_errors(
    body: request_models.OpenAIRequest | None, tools: tool_calls.ToolPlan | None
) -> Iterator[None]:
    """Name the field a grammar the engine could not compile came from (the engine
    knows only its own parameter): ``tools``, ``response_format``, or the grammar
    field itself."""
    try:
        yield
    except APIError as exc:
        found = _GRAMMAR_ERROR.match(exc.message)
        if found is not None and exc.status == 400 and exc.param is None:
            kind = found.group(1)
            exc.param = (
                f"sampling_params.{kind}" if body is None
                else "tools" if tools is not None
                else kind if getattr(body, kind) is not None
                else "response_format"
            )  # fmt: skip
        raise


def token_str(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok], skip_special_tokens=False) if st.tokenizer else str(tok)
