"""The FastAPI application: OpenAI-compatible and native routes.

The API process owns the tokenizer, chat templates and the response shapes; the
scheduler process only ever sees token ids and sampling params.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.scheduler.engine.gc_freeze import freeze_long_lived
from tandem.scheduler.text.stop import StopLimits
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server import (
    gateway,
    openapi_schemas,
    parsing,
    prepare,
    request_models,
    structured,
    tool_calls,
)
from tandem.server.config import ServerConfig
from tandem.server.dp_client import DataParallelClient
from tandem.server.errors import APIError, error_body, install_handlers
from tandem.server.front_door import authenticated, install_front_door, public_info
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
from tandem.server.lifecycle import Lifecycle
from tandem.server.metrics import Metrics
from tandem.server.parsing import Job, Limits
from tandem.server.prepare import Preparer
from tandem.server.scheduler_client import SchedulerClient

log = logging.getLogger(__name__)

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_SERVED_NAME = "default"  # the embedded default model's served name


@dataclass
class ServerState:
    client: SchedulerClient | DataParallelClient
    metrics: Metrics
    tokenizer: Tokenizer | None
    limits: Limits
    model_name: str
    config: ServerConfig
    lifecycle: Lifecycle
    preparer: Preparer
    tool_format: str = "llama3"  # tool_calls.FORMATS; see tool_format_of
    disaggregation_mode: str = "null"  # EngineConfig.disaggregation_mode
    gc_frozen_objects: int | None = None  # frozen once serving starts (``started``)

    @property
    def disaggregated(self) -> bool:
        """One half of a prefill/decode pair: every request carries bootstrap fields."""
        return self.disaggregation_mode != "null"


def tool_format_of(
    config: ServerConfig, tokenizer: Tokenizer | None, info: dict[str, Any]
) -> tuple[str, str]:
    """The tool-call format (``--tool-call-parser``, else the model's default) and why."""
    if config.tool_call_parser is not None:
        return config.tool_call_parser, "--tool-call-parser"
    template = tokenizer.chat_template if tokenizer is not None else None
    return tool_calls.default_format(template, info.get("architecture"))


def served_name(engine_kwargs: dict[str, Any], served_model_name: str | None) -> str:
    """The one model name of the server: ``--served-model-name``, else ``default`` for the
    embedded default model, else the ``--model-path`` value as given (SGLang's rule)."""
    return served_model_name or engine_kwargs.get("model_path") or DEFAULT_SERVED_NAME


def ready_line(app: FastAPI, url: str) -> str:
    """The one line ``tandem serve`` prints once it answers requests."""
    st: ServerState = app.state.tandem
    device = st.client.info["device"]
    return f'tandem is ready at {url} serving model "{st.model_name}" on {device}'


def started(app: FastAPI, url: str) -> str:
    """``tandem serve``'s API process has started: its long-lived heap is frozen
    (``tandem.scheduler.engine.gc_freeze``), and the ready line is returned."""
    st: ServerState = app.state.tandem
    st.gc_frozen_objects = freeze_long_lived()
    return ready_line(app, url)


async def _unless_stopped(start: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run ``start`` unless ``stop`` is set first (then it is cancelled): whether it ran."""
    task = asyncio.ensure_future(start)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()  # its error, if it failed
    return True


def check_disaggregation(engine_kwargs: dict[str, Any], config: ServerConfig) -> str:
    """The server's ``disaggregation_mode``; a ``ValueError`` naming ``dp_size`` when
    replicas are asked of a prefill or decode server."""
    mode = str(engine_kwargs.get("disaggregation_mode") or "null")
    if mode != "null" and config.dp_size > 1:
        # Each replica would need a bootstrap server of its own, while a gateway knows one
        # bootstrap port per prefill server.
        raise ValueError(
            f"dp_size={config.dp_size} cannot be combined with disaggregation_mode={mode}: "
            "a prefill or decode server runs one engine; start several servers and list "
            "each with the gateway instead"
        )
    return mode


def create_app(engine_kwargs: dict[str, Any], config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    mode = check_disaggregation(engine_kwargs, config)
    lifecycle = Lifecycle()
    client: SchedulerClient | DataParallelClient
    if config.dp_size > 1:
        client = DataParallelClient.launch(
            engine_kwargs, config.dp_size, config.watchdog_timeout, on_hung=lifecycle.give_up
        )
    else:
        client = SchedulerClient(
            engine_kwargs, watchdog_timeout_s=config.watchdog_timeout, on_hung=lifecycle.give_up
        )
    holder: dict[str, ServerState] = {}
    model_name = served_name(engine_kwargs, config.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[None]:
        try:
            started = await _unless_stopped(client.start(), lifecycle.stop_starting)
        except BaseException:
            await client.close()
            raise
        if not started:  # Ctrl-C or SIGTERM while the engine loaded: stop, quietly
            await client.close()
            yield
            return
        info = client.info
        tokenizer = client.tokenizer
        metrics = Metrics(lambda: client.info, lambda: client.alive)
        client.finished_listeners.append(metrics.on_finished)
        limits = Limits(
            int(info["vocab_size"]),
            int(info["context_length"]),
            prepare.max_token_chars(tokenizer),
            StopLimits(int(info["max_stop_strings"]), int(info["max_stop_string_length"])),
        )
        preparer = Preparer(config.tokenizer_workers, config.prepare_queue_size)
        tool_format, why = tool_format_of(config, tokenizer, info)
        log.info("tool calls are parsed as %s (%s)", tool_format, why)
        holder["state"] = ServerState(
            client, metrics, tokenizer, limits, model_name, config, lifecycle, preparer,
            tool_format, mode,
        )  # fmt: skip
        instance.state.tandem = holder["state"]
        try:
            yield
        finally:
            preparer.shutdown()
            await client.close()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    install_handlers(app)
    openapi_schemas.document(
        app, lambda: holder["state"].limits if "state" in holder else None, config.max_choices
    )
    install_front_door(app, config, lifecycle)
    bootstrap_required = mode != "null"  # by the routes' schemas

    def state() -> ServerState:
        return holder["state"]

    @app.get("/health", openapi_extra=openapi_schemas.HEALTH)
    async def health() -> Response:
        """200 while the scheduler answers and the server takes requests; else 503
        (draining, hung or dead), so a load balancer stops sending."""
        if "state" not in holder or not client.alive or not lifecycle.accepting:
            reason = (
                "the server is shutting down" if lifecycle.draining
                else f"the scheduler is not responding ({lifecycle.hung})" if lifecycle.hung
                else "the scheduler is not running"
            )  # fmt: skip
            return JSONResponse(error_body(reason, 503), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate", openapi_extra=openapi_schemas.UNAVAILABLE)
    async def health_generate(request: Request) -> Response:
        """SGLang's deeper check: a one-token generation through the whole path. A prefill
        or decode server cannot generate alone (half a request needs its peer): there it
        answers as ``/health`` does."""
        st = state()
        if st.disaggregated:
            return await health()
        jobs = parsing.expand(
            [[0]], {"max_new_tokens": 1, "temperature": 0}, 1, st.limits, False, 0
        )
        try:
            await asyncio.wait_for(
                collect(st.client, st.metrics, jobs, request), st.config.watchdog_timeout
            )
        except TimeoutError:
            return JSONResponse(error_body("a one-token generation timed out", 503), 503)
        except APIError as exc:
            return JSONResponse(error_body(exc.message, 503), 503)
        return JSONResponse({"status": "ok"})

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

    @app.get("/server_info")  # SGLang's newer name, which smg asks for first
    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        info = {
            **client.info, "served_model_name": model_name, "version": gateway.version(),
            "scheduler_alive": client.alive,
        }  # fmt: skip
        if "state" in holder:
            info["tool_call_parser"] = holder["state"].tool_format
            info["api_gc_frozen_objects"] = holder["state"].gc_frozen_objects
        return info if authenticated(request) else public_info(info)

    gateway.install(app, client, engine_kwargs, config.watchdog_timeout)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state().metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post(
        "/v1/completions",
        openapi_extra=openapi_schemas.openai_body(
            request_models.CompletionRequest, model_name, bootstrap_required
        ),
    )
    async def completions(request: Request) -> Response:
        st = state()
        body, jobs = await st.preparer.run(_prepare_completion, st, await request.body())
        return await _respond(st, request, body, jobs, chat=False)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=openapi_schemas.openai_body(
            request_models.ChatCompletionRequest, model_name, bootstrap_required
        ),
    )
    async def chat_completions(request: Request) -> Response:
        st = state()
        body, jobs, tools = await st.preparer.run(_prepare_chat, st, await request.body())
        return await _respond(st, request, body, jobs, chat=True, tools=tools)

    @app.post(
        "/generate",
        openapi_extra=openapi_schemas.json_body(request_models.GenerateRequest, bootstrap_required),
    )
    async def generate(request: Request) -> Response:
        st = state()
        body, jobs = await st.preparer.run(_prepare_native, st, await request.body())
        return await _native(st, request, body, jobs)

    return app


def _body(raw: bytes, model: type[request_models.M]) -> tuple[dict[str, Any], request_models.M]:
    """The raw body's JSON object, checked (``parsing.load_json``), and it as ``model``."""
    body = parsing.ensure_object(parsing.load_json(raw))
    return body, request_models.validate(model, body)


def _check_model(st: ServerState, body: dict[str, Any]) -> None:
    """A request names the served model or none (SGLang accepts a missing ``model``); a
    name of another type is left to the request's model."""
    model = body.get("model")
    if isinstance(model, str) and model != st.model_name:
        shown = model if len(model) <= 100 else model[:97] + "..."
        raise APIError(
            f"The model `{shown}` does not exist.", status=404, param="model",
            code="model_not_found",
        )  # fmt: skip


def _encode(
    st: ServerState, texts: list[str], params: list[str], special: bool = True
) -> list[list[int]]:
    """Token ids of each text; ``params[i]`` names text i in errors. A text too long to
    fit in the context is refused before it is tokenized."""
    if st.tokenizer is None:
        raise APIError("this model has no tokenizer: send token ids", param=params[0])
    for text, param in zip(texts, params, strict=True):
        parsing.check_text_length(text, st.limits, param)
    return prepare.encode(st.tokenizer, texts, special)


def _completion_prompts(
    st: ServerState, prompt: str | list[str] | list[int] | list[list[int]], n: int
) -> tuple[list[list[int]], list[str] | None]:
    """The prompts' token ids, and their texts when they came as texts (else None)."""
    texts: list[str] = []
    prompts: list[list[int]] = []
    if isinstance(prompt, str):
        texts, params = [prompt], ["prompt"]
    elif all(isinstance(p, str) for p in prompt):
        texts, params = prompt, [f"prompt[{i}]" for i in range(len(prompt))]  # type: ignore[assignment]
    elif all(isinstance(p, int) for p in prompt):
        prompts, params = [prompt], ["prompt"]  # type: ignore[list-item]
    else:
        prompts, params = prompt, [f"prompt[{i}]" for i in range(len(prompt))]  # type: ignore[assignment]
    parsing.check_fan_out(len(params), n, st.config.max_choices)
    if texts:
        prompts = _encode(st, texts, params)
    for ids, param in zip(prompts, params, strict=True):
        parsing.check_ids(ids, st.limits, param)
    return prompts, texts or None


def _text_of(content: str | list[request_models.TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _template_calls(calls: list[request_models.ToolCall], raw: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: each call's
    ``arguments`` as an object (templates print it with ``tojson``), not JSON text."""
    out = []
    for call, sent in zip(calls, raw, strict=True):
        args = call.function.arguments
        if args is None or (isinstance(args, str) and not args.strip()):
            args = {}
        elif isinstance(args, str):
            args = json.loads(args)  # an object: the model checked it
        out.append({**sent, "function": {**sent["function"], "arguments": args}})
    return out


def _chat_prompt(
    st: ServerState,
    body: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    chat: request_models.ChatCompletionRequest | None = None,
) -> list[int]:
    """The conversation's token ids; ``chat``: ``body`` as its model, when checked already."""
    if chat is None:
        chat = request_models.validate(request_models.ChatCompletionRequest, body)
    clean = []
    for msg, sent in zip(chat.messages, body["messages"], strict=True):
        entry = dict(sent)  # other fields (name, tool_call_id...) reach the template as sent
        calls = getattr(msg, "tool_calls", None)
        if calls is not None:
            entry["tool_calls"] = _template_calls(calls, sent["tool_calls"])
        # An assistant turn of calls only: templates that join ``content`` as a string
        # (SmolLM2's ChatML among them) need one, as vLLM gives them.
        entry["content"] = "" if msg.content is None else _text_of(msg.content)
        clean.append(entry)
    if st.tokenizer is None or st.tokenizer.chat_template is None:
        raise APIError("this model has no chat template", param="messages")
    try:
        if st.config.special_tokens_in_content:
            text = st.tokenizer.apply_chat_template(clean, tools=tools)
            pieces = [(text, False)]
        else:
            pieces = st.tokenizer.chat_pieces(clean, tools=tools)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
        raise APIError(f"the chat template failed: {exc}", param="messages") from None
    parsing.check_text_length("".join(text for text, _ in pieces), st.limits, "messages")
    # The rendered template carries its own special tokens (BOS included).
    ids = st.tokenizer.encode_pieces(pieces)
    parsing.check_ids(ids, st.limits, "messages")
    return ids


# -- preparation: run on the Preparer's threads, never on the event loop ------------------------
def _prepare_completion(
    st: ServerState, raw: bytes
) -> tuple[request_models.CompletionRequest, list[Job]]:
    body, req = _body(raw, request_models.CompletionRequest)
    _check_model(st, body)
    echo = bool(req.echo)
    n = req.n or 1
    params = parsing.sampling_from_openai(req, st.limits)
    params.update(structured.openai_grammar(body))
    top = req.logprobs
    prompts, texts = _completion_prompts(st, req.prompt, n)
    boot = parsing.bootstrap(body, st.disaggregated, len(prompts), lists=True)
    parsing.check_one_choice(boot, n)
    if echo and st.tokenizer is None:
        raise APIError("echo needs the model's tokenizer, which this model lacks", param="echo")
    if echo and top is not None and st.disaggregated:
        raise APIError(
            "echo with logprobs (the prompt's logprobs) is not supported with prefill/decode "
            "disaggregation",
            param="echo",
        )
    jobs = parsing.expand(
        prompts, params, n, st.limits, top is not None, top or 0,
        default_max=_COMPLETIONS_DEFAULT_MAX_TOKENS, logprob_start_len=0 if echo else -1,
    )  # fmt: skip
    if echo:
        assert st.tokenizer is not None
        for job in jobs:
            p = job.index // n
            skip = bool(job.params.get("skip_special_tokens", True))
            job.echo = texts[p] if texts else st.tokenizer.decode(prompts[p], skip)
    return req, parsing.with_bootstrap(jobs, boot)


def _prepare_chat(
    st: ServerState, raw: bytes
) -> tuple[request_models.ChatCompletionRequest, list[Job], tool_calls.ToolPlan | None]:
    body, req = _body(raw, request_models.ChatCompletionRequest)
    _check_model(st, body)
    n = req.n or 1
    parsing.check_fan_out(1, n, st.config.max_choices)
    boot = parsing.bootstrap(body, st.disaggregated)
    parsing.check_one_choice(boot, n)
    params = parsing.sampling_from_openai(req, st.limits)
    grammar = structured.openai_grammar(body)
    plan = tool_calls.plan(body, st.tool_format)
    if plan is not None and grammar:
        given = next((k for k in grammar if body.get(k) is not None), "response_format")
        raise APIError(
            f"{given} cannot be combined with tools unless tool_choice is none: a tool "
            "call's output has its own grammar",
            param=given,
        )
    params.update(plan.grammar if plan is not None else grammar)
    want = bool(req.logprobs)
    top = req.top_logprobs or 0
    if top and not want:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    ids = _chat_prompt(st, body, plan.template_tools if plan is not None else None, req)
    jobs = parsing.expand([ids], params, n, st.limits, want, top)
    return req, parsing.with_bootstrap(jobs, boot), plan


def _prepare_native(
    st: ServerState, raw: bytes
) -> tuple[request_models.GenerateRequest, list[Job]]:
    body, req = _body(raw, request_models.GenerateRequest)
    if (req.text is None) == (req.input_ids is None):
        raise APIError("pass exactly one of text and input_ids", param="text")
    params = parsing.native_sampling(req.sampling_params, st.limits)
    want = bool(req.return_logprob)
    top = req.top_logprobs_num or 0
    start = -1 if req.logprob_start_len is None else req.logprob_start_len
    if req.return_text_in_logprobs and st.tokenizer is None:
        raise APIError(
            "return_text_in_logprobs needs the model's tokenizer, which this model lacks",
            param="return_text_in_logprobs",
        )
    boot = parsing.bootstrap(body, st.disaggregated)
    if req.text is not None:
        ids, param = _encode(st, [req.text], ["text"])[0], "text"
    else:
        assert req.input_ids is not None
        ids, param = req.input_ids, "input_ids"
    parsing.check_ids(ids, st.limits, param)
    if start >= 0 and want and st.disaggregated:
        raise APIError(
            "prompt logprobs (logprob_start_len) are not supported with prefill/decode "
            "disaggregation",
            param="logprob_start_len",
        )
    jobs = parsing.expand(
        [ids], params, 1, st.limits, want, top, default_max=128, prefix="sampling_params.",
        logprob_start_len=start,
    )  # fmt: skip
    return req, parsing.with_bootstrap(jobs, boot)


# -- OpenAI responses --------------------------------------------------------------------------
def _token_str(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok], skip_special_tokens=False) if st.tokenizer else str(tok)


def _completion_logprobs(
    st: ServerState, lps: list[list[Any]], tops: list[Any], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs: each token's text, logprob and top alternatives (a
    ``None`` logprob, and ``None`` alternatives, for the first token of an echoed prompt),
    and its character offset, counted from ``offset`` over the tokens' texts (as vLLM)."""
    tokens = [_token_str(st, int(t)) for _, t, *_ in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, *_ in lps],
        "top_logprobs": [None if step is None else _alternatives(st, step) for step in tops]
        or None,
        "text_offset": offsets,
    }


def _alternatives(st: ServerState, step: list[list[Any]]) -> dict[str, float]:
    """One step's top alternatives as ``{text: logprob}``, most likely first; where two
    tokens share a text (byte pieces), the more likely one's logprob is kept."""
    out: dict[str, float] = {}
    for lp, tok, *_ in step:
        out.setdefault(_token_str(st, int(tok)), lp)
    return out


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
    st: ServerState,
    request: Request,
    body: request_models.OpenAIRequest,
    jobs: list[Job],
    chat: bool,
    tools: tool_calls.ToolPlan | None = None,
) -> Response:
    stream = bool(body.stream)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = st.model_name
    if not stream:
        with _grammar_errors(body, tools):
            choices = await collect(st.client, st.metrics, jobs, request)
        for c in choices:
            _check_handed_over(jobs, c.meta)
        completion = sum(len(c.ids) for c in choices)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [_full_choice(st, c, jobs, chat, tools) for c in choices],
                "usage": _usage(jobs, completion),
            }
        )
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    with _grammar_errors(body, tools):
        first, events = await first_then_rest(run_jobs(st.client, st.metrics, jobs))
    if first is not None:
        try:
            _check_handed_over(jobs, first.meta)
        except APIError:
            await events.aclose()  # type: ignore[attr-defined]
            raise
    kind = "chat.completion.chunk" if chat else "text_completion"

    def frame(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        out: dict[str, Any] = {
            "id": rid, "object": kind, "created": created, "model": model, "choices": choices,
        }  # fmt: skip
        if include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    calls = {j.index: tools.stream() for j in jobs} if tools is not None else {}
    # echo: each choice's first chunk starts with its prompt (vLLM's way).
    echoes = {j.index: j.echo for j in jobs if j.echo is not None}
    sent = {j.index: 0 for j in jobs}  # characters each choice's chunks held so far

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
                    _check_handed_over(jobs, event.meta)
                    completion += len(event.ids)
                    if not event.text and event.finish_reason is None and not event.ids:
                        continue
                    if event.index in calls:
                        for choice in _tool_deltas(st, event, calls[event.index]):
                            yield frame([choice])
                    else:
                        echo = echoes.pop(event.index, None)
                        choice = _delta_choice(st, event, chat, echo, sent[event.index])
                        if not chat:
                            sent[event.index] += len(choice["text"])
                        yield frame([choice])
        except Exception as exc:  # noqa: BLE001 - reported in-band, then the stream ends
            yield f"data: {json.dumps(as_api_error(exc).body())}\n\ndata: [DONE]\n\n"
            return
        if include_usage:
            yield frame([], _usage(jobs, completion))
        yield "data: [DONE]\n\n"

    return ClosingStreamingResponse(
        until_disconnect(request, sse()), media_type="text/event-stream"
    )


def _check_handed_over(jobs: list[Job], meta: dict[str, Any]) -> None:
    """A disaggregated request that the engine ended (its peer failed, timed out or was
    unreachable) as an error: OpenAI's finish reasons have no word for it, and a
    ``stop`` with the text cut short would pass for an answer. (``/generate`` shows the
    engine's ``finish_reason`` itself, with its message.)"""
    reason = meta.get("finish_reason")
    if jobs[0].bootstrap is None or not isinstance(reason, dict) or reason.get("type") != "abort":
        return
    message = reason.get("message") or "the request was aborted"
    raise APIError(
        f"prefill/decode disaggregation failed: {message}", status=503, code="disaggregation_failed"
    )


_GRAMMAR_ERROR = re.compile(r"request \d+: (json_schema|regex|ebnf|structural_tag): ")


@contextlib.contextmanager
def _grammar_errors(
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


def _full_choice(
    st: ServerState, c: Choice, jobs: list[Job], chat: bool, tools: tool_calls.ToolPlan | None
) -> dict[str, Any]:
    body: dict[str, Any] = (
        {"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text}
    )
    reason = c.finish_reason
    if tools is not None:
        content, calls = tools.stream().parse(c.text)
        body["message"]["content"] = content
        if calls:
            body["message"]["tool_calls"] = [call.openai() for call in calls]
            reason = "tool_calls" if reason == "stop" else reason
    want = jobs[0].return_logprob
    job = next((j for j in jobs if j.index == c.index), jobs[0])
    if job.echo is None:
        return _choice(st, c.index, body, c.logprobs, c.top_logprobs, want, reason, chat)
    body["text"] = job.echo + c.text
    lps, tops = _echoed(c.input_logprobs, c.input_top_logprobs, c.logprobs, c.top_logprobs)
    return _choice(st, c.index, body, lps, tops, want, reason, chat)


def _echoed(
    prompt_lps: list[list[Any]] | None,
    prompt_tops: list[Any] | None,
    lps: list[list[Any]],
    tops: list[Any],
) -> tuple[list[list[Any]], list[Any]]:
    """``echo``'s logprobs: the prompt's (the first token's ``None``) before the
    completion's; alternatives only where the completion has them."""
    prompt_tops = prompt_tops or []
    return [*(prompt_lps or []), *lps], [*prompt_tops, *tops] if prompt_tops else tops


def _tool_deltas(st: ServerState, e: Event, stream: tool_calls.CallStream) -> list[dict[str, Any]]:
    """A chat event's choices with tool calls parsed out: text as ``content``, each call
    as its name, then its arguments, in OpenAI's ``tool_calls`` delta shape. Logprobs
    ride on the first, the finish reason on the last."""
    pieces = stream.feed(e.text)
    if e.finish_reason is not None:
        pieces += stream.finish()
    deltas: list[dict[str, Any]] = []
    # The call in progress before these pieces (-1: none yet).
    index = stream.calls - sum(isinstance(p, tool_calls.CallHead) for p in pieces) - 1
    args: dict[str, str] | None = None  # the last arguments delta, which a part extends
    for piece in pieces:
        if isinstance(piece, str):
            deltas.append({"content": piece})
            args = None
        elif isinstance(piece, tool_calls.CallHead):
            index += 1
            head = {"index": index, "id": piece.id, "type": "function"}
            deltas.append(
                {"tool_calls": [{**head, "function": {"name": piece.name, "arguments": ""}}]}
            )
            args = None
        elif args is not None:
            args["arguments"] += piece.text
        else:
            args = {"arguments": piece.text}
            deltas.append({"tool_calls": [{"index": index, "function": args}]})
    if not deltas:
        if e.finish_reason is None and not e.logprobs:
            return []  # text held back: it may open a call
        deltas = [{}]
    reason = e.finish_reason
    if reason == "stop" and stream.calls:
        reason = "tool_calls"
    out = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        want = bool(e.logprobs) and i == 0
        out.append(
            _choice(st, e.index, {"delta": delta}, e.logprobs, e.top_logprobs, want,
                    reason if last else None, True)
        )  # fmt: skip
    return out


def _delta_choice(
    st: ServerState, e: Event, chat: bool, echo: str | None = None, offset: int = 0
) -> dict[str, Any]:
    """One event as a chunk's choice; ``echo``: the prompt's text, which this first chunk
    of a completion's choice starts with (and its logprobs with the prompt's);
    ``offset``: the characters the choice's earlier chunks held (``text_offset``)."""
    if chat:
        body = {"delta": {"content": e.text} if e.text else {}}
        want = bool(e.logprobs)
        return _choice(st, e.index, body, e.logprobs, e.top_logprobs, want, e.finish_reason, True)
    lps, tops = e.logprobs, e.top_logprobs
    if echo is not None:
        lps, tops = _echoed(e.input_logprobs, e.input_top_logprobs, lps, tops)
    body = {"text": e.text if echo is None else echo + e.text}
    want = bool(lps)
    return _choice(st, e.index, body, lps, tops, want, e.finish_reason, False, offset)


def _choice(
    st: ServerState,
    index: int,
    body: dict[str, Any],
    logprobs: Any,
    top_logprobs: Any,
    want: bool,
    finish_reason: Any,
    chat: bool,
    offset: int = 0,
) -> dict[str, Any]:
    """One choice of a response or a chunk: index, content, logprobs, finish reason;
    ``offset``: where a completion chunk's ``text_offset`` counts from."""
    rendered = None
    if want:
        rendered = (
            _chat_logprobs(st, logprobs, top_logprobs)
            if chat
            else _completion_logprobs(st, logprobs, top_logprobs, offset)
        )
    return {"index": index, **body, "logprobs": rendered, "finish_reason": finish_reason}


# -- SGLang's native /generate -------------------------------------------------------------------
async def _native(
    st: ServerState, request: Request, body: request_models.GenerateRequest, jobs: list[Job]
) -> Response:
    rid = body.rid
    texts = bool(body.return_text_in_logprobs)
    shape = _NativeLogprobs(
        jobs[0].return_logprob,
        jobs[0].logprob_start_len >= 0,
        functools.partial(_token_str, st) if texts else None,
    )
    if not body.stream:
        with _grammar_errors(None, None):
            choice = (await collect(st.client, st.metrics, jobs, request, rid))[0]
        return JSONResponse(_native_result(choice.text, choice.ids, choice, shape))
    with _grammar_errors(None, None):
        first, events = await first_then_rest(run_jobs(st.client, st.metrics, jobs, rid))

    async def sse() -> AsyncIterator[str]:
        acc = Choice(0)
        try:
            async with contextlib.aclosing(with_first(first, events)) as all_events:
                async for event in all_events:
                    acc.add(event)
                    yield f"data: {json.dumps(_native_result(acc.text, acc.ids, acc, shape))}\n\n"
        except Exception as exc:  # noqa: BLE001 - reported in-band
            yield f"data: {json.dumps(as_api_error(exc).body())}\n\ndata: [DONE]\n\n"
            return
        yield "data: [DONE]\n\n"

    return ClosingStreamingResponse(
        until_disconnect(request, sse()), media_type="text/event-stream"
    )


@dataclass(frozen=True)
class _NativeLogprobs:
    """What ``/generate``'s ``meta_info`` holds of logprobs: the output's (``want``), the
    prompt's too (``prompt``), with each token's text (``text``) or ``null``."""

    want: bool
    prompt: bool
    text: Callable[[int], str] | None


def _native_result(text: str, ids: list[int], c: Choice, shape: _NativeLogprobs) -> dict[str, Any]:
    meta = dict(c.meta)
    if shape.want:
        name = shape.text

        def triples(pairs: list[list[Any]] | None) -> list[list[Any]] | None:
            """SGLang's ``[logprob, token_id, text or null]`` entries."""
            if pairs is None:
                return None
            return [[lp, tok, name(int(tok)) if name else None] for lp, tok, *_ in pairs]

        meta["output_token_logprobs"] = triples(c.logprobs)
        meta["output_top_logprobs"] = [triples(step) for step in c.top_logprobs]
        if shape.prompt:
            meta["input_token_logprobs"] = triples(c.input_logprobs)
            meta["input_top_logprobs"] = [triples(step) for step in c.input_top_logprobs]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}
