"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``, from a request's body to its jobs (on the ``Preparer``'s
threads, never on the event loop) and from the jobs' deltas to OpenAI's response and
chunk shapes: choices, tool calls, logprobs, ``echo`` and usage."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tandem.scheduler.engine.delivery import Delta
from tandem.server import openapi_schemas, parsing, request_models, sse, structured, tool_calls
from tandem.server.errors import APIError
from tandem.server.generation import Choice, collect, first_then_rest, run_jobs, with_first
from tandem.server.parsing import Job
from tandem.server.routes.common import (
    encode,
    grammar_errors,
    read_body,
    server_state,
    token_str,
)

if TYPE_CHECKING:
    from tandem.server.app import ServerState

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def router(model_name: str, bootstrap_required: bool) -> APIRouter:
    """The routes; ``model_name`` and ``bootstrap_required`` shape their request schemas."""
    routes = APIRouter()

    @routes.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        st = server_state(request)
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

    @routes.post(
        "/v1/completions",
        openapi_extra=openapi_schemas.openai_body(
            request_models.CompletionRequest, model_name, bootstrap_required
        ),
    )
    async def completions(request: Request) -> Response:
        st = server_state(request)
        body, jobs = await st.preparer.run(_prepare_completion, st, await request.body())
        return await _respond(st, request, body, jobs, chat=False)

    @routes.post(
        "/v1/chat/completions",
        openapi_extra=openapi_schemas.openai_body(
            request_models.ChatCompletionRequest, model_name, bootstrap_required
        ),
    )
    async def chat_completions(request: Request) -> Response:
        st = server_state(request)
        body, jobs, tools = await st.preparer.run(_prepare_chat, st, await request.body())
        return await _respond(st, request, body, jobs, chat=True, tools=tools)

    return routes


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
        prompts = encode(st, texts, params)
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


def _prepare_completion(
    st: ServerState, raw: bytes
) -> tuple[request_models.CompletionRequest, list[Job]]:
    body, req = read_body(raw, request_models.CompletionRequest)
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
    body, req = read_body(raw, request_models.ChatCompletionRequest)
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


def _completion_logprobs(
    st: ServerState, lps: list[list[Any]], tops: list[Any], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs: each token's text, logprob and top alternatives (a
    ``None`` logprob, and ``None`` alternatives, for the first token of an echoed prompt),
    and its character offset, counted from ``offset`` over the tokens' texts (as vLLM)."""
    tokens = [token_str(st, int(t)) for _, t, *_ in lps]
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
        out.setdefault(token_str(st, int(tok)), lp)
    return out


def _chat_logprobs(st: ServerState, lps: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
    content = []
    for i, (lp, tok, *_) in enumerate(lps):
        s = token_str(st, int(tok))
        alts = tops[i] if i < len(tops) else []
        content.append(
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {
                        "token": (a := token_str(st, int(t))),
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
        with grammar_errors(body, tools):
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
    with grammar_errors(body, tools):
        first, deltas = await first_then_rest(run_jobs(st.client, st.metrics, jobs))
    if first is not None:
        try:
            _check_handed_over(jobs, first.meta)
        except APIError:
            await deltas.aclose()  # type: ignore[attr-defined]
            raise
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid, "object": kind, "created": created, "model": model, "choices": choices,
        }  # fmt: skip
        if include_usage:
            out["usage"] = usage
        return out

    calls = {j.index: tools.stream() for j in jobs} if tools is not None else {}
    # echo: each choice's first chunk starts with its prompt (vLLM's way).
    echoes = {j.index: j.echo for j in jobs if j.echo is not None}
    sent = {j.index: 0 for j in jobs}  # characters each choice's chunks held so far

    async def chunks() -> AsyncGenerator[dict[str, Any], None]:
        completion = 0
        if chat:
            yield chunk(
                [
                    {"index": j.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
                    for j in jobs
                ]
            )  # fmt: skip
        async with contextlib.aclosing(with_first(first, deltas)) as all_deltas:
            async for delta in all_deltas:
                _check_handed_over(jobs, delta.meta)
                completion += len(delta.ids)
                if not delta.text and delta.finish_reason is None and not delta.ids:
                    continue
                if delta.index in calls:
                    for choice in _tool_deltas(st, delta, calls[delta.index]):
                        yield chunk([choice])
                else:
                    echo = echoes.pop(delta.index, None)
                    choice = _delta_choice(st, delta, chat, echo, sent[delta.index])
                    if not chat:
                        sent[delta.index] += len(choice["text"])
                    yield chunk([choice])
        if include_usage:
            yield chunk([], _usage(jobs, completion))

    return sse.response(request, chunks())


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


def _tool_deltas(st: ServerState, e: Delta, stream: tool_calls.CallStream) -> list[dict[str, Any]]:
    """A chat delta's choices with tool calls parsed out: text as ``content``, each call
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
    st: ServerState, e: Delta, chat: bool, echo: str | None = None, offset: int = 0
) -> dict[str, Any]:
    """One delta as a chunk's choice; ``echo``: the prompt's text, which this first chunk
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
