"""The FastAPI application: OpenAI-compatible and native routes.

The API process owns the tokenizer, chat templates and the response shapes; the
scheduler process only ever sees token ids and sampling params.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.scheduler.tokenizer import Tokenizer
from tandem.server import openapi_schemas, parsing
from tandem.server.config import ServerConfig
from tandem.server.lifecycle import Lifecycle
from tandem.server.errors import APIError, error_body, install_handlers
from tandem.server.generation import (
    Choice,
    ClosingStreamingResponse,
    Event,
    as_api_error,
    collect,
    first_then_rest,
    run_jobs,
    until_disconnect,
    with_first,
)
from tandem.server.metrics import Metrics
from tandem.server.parsing import Job, Limits
from tandem.server.scheduler_client import SchedulerClient

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_SERVED_NAME = "default"  # the embedded default model's served name


@dataclass
class ServerState:
    client: SchedulerClient
    metrics: Metrics
    tokenizer: Tokenizer | None
    limits: Limits
    model_name: str
    config: ServerConfig
    lifecycle: Lifecycle


def served_name(engine_kwargs: dict[str, Any], served_model_name: str | None) -> str:
    """The one model name of the server: ``--served-model-name``, else ``default`` for the
    embedded default model, else the ``--model-path`` value as given (SGLang's rule)."""
    return served_model_name or engine_kwargs.get("model_path") or DEFAULT_SERVED_NAME


def ready_line(app: FastAPI, url: str) -> str:
    """The one line ``tandem serve`` prints once it answers requests."""
    st: ServerState = app.state.tandem
    device = st.client.info["device"]
    return f'tandem is ready at {url} serving model "{st.model_name}" on {device}'


def create_app(engine_kwargs: dict[str, Any], config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    client = SchedulerClient(engine_kwargs)
    holder: dict[str, ServerState] = {}
    lifecycle = Lifecycle()
    model_name = served_name(engine_kwargs, config.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[None]:
        try:
            await client.start()
        except BaseException:
            await client.close()
            raise
        info = client.info
        path = Path(engine_kwargs.get("tokenizer_path") or info["model_path"])
        tokenizer = Tokenizer.from_pretrained(path) if (path / "tokenizer.json").exists() else None
        metrics = Metrics(lambda: client.info)
        client.finished_listeners.append(metrics.on_finished)
        limits = Limits(int(info["vocab_size"]), int(info["context_length"]))
        holder["state"] = ServerState(
            client, metrics, tokenizer, limits, model_name, config, lifecycle
        )
        instance.state.tandem = holder["state"]
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    install_handlers(app)

    def state() -> ServerState:
        return holder["state"]

    @app.get("/health", openapi_extra=openapi_schemas.UNAVAILABLE)
    async def health() -> Response:
        if "state" not in holder or not client.alive:
            return JSONResponse(error_body("the scheduler is not running", 503), 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        st = state()
        return {
            "object": "list",
            "data": [
                {
                    "id": st.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tandem",
                    "max_model_len": st.limits.context_length,
                }
            ],
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {**client.info, "scheduler_alive": client.alive}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state().metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post(
        "/v1/completions",
        openapi_extra=openapi_schemas.openai_body(openapi_schemas.COMPLETION_REQUEST, model_name),
    )
    async def completions(request: Request) -> Response:
        st = state()
        body = parsing.ensure_object(await _json(request))
        _check_model(st, body)
        prompts = _completion_prompts(st, body.get("prompt"))
        if parsing._bool(body, "echo"):
            raise APIError("echo is not supported", param="echo")
        n = parsing.choices_count(body)
        params = parsing.sampling_from_openai(body)
        top = parsing._typed(body, "logprobs", int, "an integer")
        if top is not None and not 0 <= top <= parsing.MAX_TOP_LOGPROBS:
            raise APIError("logprobs must be in [0, 20]", param="logprobs")
        jobs = parsing.expand(
            prompts, params, n, st.limits, top is not None, top or 0,
            default_max=_COMPLETIONS_DEFAULT_MAX_TOKENS,
        )  # fmt: skip
        return await _respond(st, request, body, jobs, chat=False)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=openapi_schemas.openai_body(
            openapi_schemas.CHAT_COMPLETION_REQUEST, model_name
        ),
    )
    async def chat_completions(request: Request) -> Response:
        st = state()
        body = parsing.ensure_object(await _json(request))
        _check_model(st, body)
        ids = _chat_prompt(st, body)
        n = parsing.choices_count(body)
        params = parsing.sampling_from_openai(body)
        want = parsing._bool(body, "logprobs")
        top = parsing._typed(body, "top_logprobs", int, "an integer", 0)
        if not 0 <= top <= parsing.MAX_TOP_LOGPROBS:
            raise APIError("top_logprobs must be in [0, 20]", param="top_logprobs")
        if top and not want:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        jobs = parsing.expand([ids], params, n, st.limits, want, top)
        return await _respond(st, request, body, jobs, chat=True)

    @app.post(
        "/generate", openapi_extra=openapi_schemas.json_body(openapi_schemas.GENERATE_REQUEST)
    )
    async def generate(request: Request) -> Response:
        st = state()
        body = parsing.ensure_object(await _json(request))
        return await _native(st, request, body)

    return app


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the body is not valid JSON: {exc}") from None


def _check_model(st: ServerState, body: dict[str, Any]) -> None:
    """A request names the served model or none (SGLang accepts a missing ``model``)."""
    model = parsing._typed(body, "model", str, "a string")
    if model is not None and model != st.model_name:
        raise APIError(
            f"The model `{model}` does not exist.", status=404, param="model",
            code="model_not_found",
        )  # fmt: skip


def _encode(st: ServerState, text: str, param: str, special: bool = True) -> list[int]:
    if st.tokenizer is None:
        raise APIError("this model has no tokenizer: send token ids", param=param)
    return st.tokenizer.encode(text, add_special_tokens=special)


def _completion_prompts(st: ServerState, prompt: Any) -> list[list[int]]:
    if prompt is None:
        raise APIError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        prompts = [_encode(st, prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [_encode(st, p, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise APIError("prompt must be a string, a list of strings, or token ids", param="prompt")
    for ids in prompts:
        parsing.check_ids(ids, st.limits, "prompt")
    return prompts


def _chat_prompt(st: ServerState, body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a role", param="messages")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(
                        f"messages[{i}]: only text content is supported", param="messages"
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string", param="messages")
        clean.append({**msg, "content": content})
    if st.tokenizer is None or st.tokenizer.chat_template is None:
        raise APIError("this model has no chat template", param="messages")
    try:
        text = st.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
        raise APIError(f"the chat template failed: {exc}", param="messages") from None
    # The rendered template carries its own special tokens (BOS included).
    ids = _encode(st, text, "messages", special=False)
    parsing.check_ids(ids, st.limits, "messages")
    return ids


# -- OpenAI responses --------------------------------------------------------------------------
def _token_str(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok], skip_special_tokens=False) if st.tokenizer else str(tok)


def _completion_logprobs(st: ServerState, lps: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
    return {
        "tokens": [_token_str(st, int(t)) for _, t, *_ in lps],
        "token_logprobs": [lp for lp, *_ in lps],
        "top_logprobs": [{_token_str(st, int(t)): lp for lp, t, *_ in step} for step in tops]
        or None,
        "text_offset": [],
    }


def _chat_logprobs(st: ServerState, lps: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
    content = []
    for i, (lp, tok, *_) in enumerate(lps):
        s = _token_str(st, int(tok))
        alts = tops[i] if i < len(tops) else []
        content.append(
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {
                        "token": (a := _token_str(st, int(t))),
                        "logprob": v,
                        "bytes": list(a.encode()),
                    }
                    for v, t, *_ in alts
                ],
            }
        )
    return {"content": content}


def _usage(jobs: list[Job], completion_tokens: int) -> dict[str, int]:
    seen: set[int] = set()
    prompt = 0
    for job in jobs:
        if id(job.prompt_ids) not in seen:
            seen.add(id(job.prompt_ids))
            prompt += len(job.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


async def _respond(
    st: ServerState, request: Request, body: dict[str, Any], jobs: list[Job], chat: bool
) -> Response:
    stream = parsing._bool(body, "stream")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = st.model_name
    if not stream:
        choices = await collect(st.client, st.metrics, jobs, request)
        completion = sum(len(c.ids) for c in choices)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [_full_choice(st, c, jobs, chat) for c in choices],
                "usage": _usage(jobs, completion),
            }
        )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    include_usage = bool((options or {}).get("include_usage"))
    first, events = await first_then_rest(run_jobs(st.client, st.metrics, jobs))
    kind = "chat.completion.chunk" if chat else "text_completion"

    def frame(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        out: dict[str, Any] = {
            "id": rid, "object": kind, "created": created, "model": model, "choices": choices,
        }  # fmt: skip
        if include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    async def sse() -> AsyncIterator[str]:
        completion = 0
        try:
            if chat:
                yield frame(
                    [
                        {"index": j.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}
                        for j in jobs
                    ]
                )  # fmt: skip
            async with contextlib.aclosing(with_first(first, events)) as all_events:
                async for event in all_events:
                    completion += len(event.ids)
                    if not event.text and event.finish_reason is None and not event.ids:
                        continue
                    yield frame([_delta_choice(st, event, chat)])
        except Exception as exc:  # noqa: BLE001 - reported in-band, then the stream ends
            err = as_api_error(exc)
            yield f"data: {json.dumps(err.body())}\n\n"
            return
        if include_usage:
            yield frame([], _usage(jobs, completion))
        yield "data: [DONE]\n\n"

    return ClosingStreamingResponse(
        until_disconnect(request, sse()), media_type="text/event-stream"
    )


def _full_choice(st: ServerState, c: Choice, jobs: list[Job], chat: bool) -> dict[str, Any]:
    body = {"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text}
    want = jobs[0].return_logprob
    return _choice(st, c.index, body, c.logprobs, c.top_logprobs, want, c.finish_reason, chat)


def _delta_choice(st: ServerState, e: Event, chat: bool) -> dict[str, Any]:
    body = {"delta": {"content": e.text} if e.text else {}} if chat else {"text": e.text}
    want = bool(e.logprobs)
    return _choice(st, e.index, body, e.logprobs, e.top_logprobs, want, e.finish_reason, chat)


def _choice(
    st: ServerState,
    index: int,
    body: dict[str, Any],
    logprobs: Any,
    top_logprobs: Any,
    want: bool,
    finish_reason: Any,
    chat: bool,
) -> dict[str, Any]:
    """One choice of a response or a chunk: index, content, logprobs, finish reason."""
    render = _chat_logprobs if chat else _completion_logprobs
    return {
        "index": index,
        **body,
        "logprobs": render(st, logprobs, top_logprobs) if want else None,
        "finish_reason": finish_reason,
    }


# -- SGLang's native /generate -------------------------------------------------------------------
async def _native(st: ServerState, request: Request, body: dict[str, Any]) -> Response:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise APIError("pass exactly one of text and input_ids", param="text")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise APIError("text must be a non-empty string", param="text")
        ids = _encode(st, text, "text")
    else:
        if not isinstance(input_ids, list):
            raise APIError("input_ids must be a list of token ids", param="input_ids")
        ids = list(input_ids)
    parsing.check_ids(ids, st.limits, "text" if text is not None else "input_ids")
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, dict):
        raise APIError("sampling_params must be an object", param="sampling_params")
    raw = dict(raw)
    n = raw.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n != 1:
        raise APIError("/generate takes n=1", param="sampling_params.n")
    raw.setdefault("max_new_tokens", min(128, st.limits.context_length - len(ids)))
    want = parsing._bool(body, "return_logprob")
    top = parsing._typed(body, "top_logprobs_num", int, "an integer", 0)
    rid = parsing._typed(body, "rid", str, "a string")
    jobs = parsing.expand([ids], raw, 1, st.limits, want, top)
    if not parsing._bool(body, "stream"):
        choice = (await collect(st.client, st.metrics, jobs, request, rid))[0]
        return JSONResponse(_native_result(choice.text, choice.ids, choice, want))
    first, events = await first_then_rest(run_jobs(st.client, st.metrics, jobs, rid))

    async def sse() -> AsyncIterator[str]:
        acc = Choice(0)
        try:
            async with contextlib.aclosing(with_first(first, events)) as all_events:
                async for event in all_events:
                    acc.add(event)
                    yield f"data: {json.dumps(_native_result(acc.text, acc.ids, acc, want))}\n\n"
        except Exception as exc:  # noqa: BLE001 - reported in-band
            yield f"data: {json.dumps(as_api_error(exc).body())}\n\n"
            return
        yield "data: [DONE]\n\n"

    return ClosingStreamingResponse(
        until_disconnect(request, sse()), media_type="text/event-stream"
    )


def _native_result(text: str, ids: list[int], c: Choice, want: bool) -> dict[str, Any]:
    meta = dict(c.meta)
    if want:
        meta["output_token_logprobs"] = c.logprobs
        meta["output_top_logprobs"] = c.top_logprobs
    return {"text": text, "output_ids": list(ids), "meta_info": meta}
