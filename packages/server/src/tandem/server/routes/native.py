"""SGLang's native ``/generate``: a text or token ids in, SGLang's ``text``,
``output_ids`` and ``meta_info`` out, whole or streamed (each frame carries the output
so far, as SGLang's does)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tandem.server import openapi_schemas, parsing, request_models, sse
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


def router(bootstrap_required: bool) -> APIRouter:
    """The route; ``bootstrap_required`` shapes its request schema."""
    routes = APIRouter()

    @routes.post(
        "/generate",
        openapi_extra=openapi_schemas.json_body(request_models.GenerateRequest, bootstrap_required),
    )
    async def generate(request: Request) -> Response:
        st = server_state(request)
        body, jobs = await st.preparer.run(_prepare_native, st, await request.body())
        return await _native(st, request, body, jobs)

    return routes


def _prepare_native(
    st: ServerState, raw: bytes
) -> tuple[request_models.GenerateRequest, list[Job]]:
    body, req = read_body(raw, request_models.GenerateRequest)
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
        ids, param = encode(st, [req.text], ["text"])[0], "text"
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


async def _native(
    st: ServerState, request: Request, body: request_models.GenerateRequest, jobs: list[Job]
) -> Response:
    rid = body.rid
    texts = bool(body.return_text_in_logprobs)
    shape = _NativeLogprobs(
        jobs[0].return_logprob,
        jobs[0].logprob_start_len >= 0,
        functools.partial(token_str, st) if texts else None,
    )
    if not body.stream:
        with grammar_errors(None, None):
            choice = (await collect(st.client, st.metrics, jobs, request, rid))[0]
        return JSONResponse(_native_result(choice.text, choice.ids, choice, shape))
    with grammar_errors(None, None):
        first, deltas = await first_then_rest(run_jobs(st.client, st.metrics, jobs, rid))

    async def results() -> AsyncGenerator[dict[str, Any], None]:
        acc = Choice(0)
        async with contextlib.aclosing(with_first(first, deltas)) as all_deltas:
            async for delta in all_deltas:
                acc.add(delta)
                yield _native_result(acc.text, acc.ids, acc, shape)

    return sse.response(request, results())


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
