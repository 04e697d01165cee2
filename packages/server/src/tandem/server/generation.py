"""Running a request's jobs against the scheduler: merging choices, watching the client.

Choices of one request (``n`` and several prompts) run concurrently and their chunks
are merged in arrival order. Leaving the merged iterator early cancels every job, which
aborts them in the scheduler, so a client that went away frees its KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.sampling import SamplingParams
from tandem.scheduler.text.detokenizer import IncrementalDetokenizer
from tandem.scheduler.text.stop import StopChecker
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server.errors import APIError
from tandem.server.metrics import Metrics
from tandem.server.parsing import Job
from tandem.server.scheduler_client import RequestFailed, SchedulerClient, SchedulerUnavailable

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """A finished choice, accumulated from its deltas."""

    index: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[list[Any]] = field(default_factory=list)
    top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    input_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[list[list[Any]] | None] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.ids.extend(delta.ids)
        self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs)
        if delta.input_logprobs is not None:
            self.input_logprobs = delta.input_logprobs
            self.input_top_logprobs = delta.input_top_logprobs or []
        self.meta = delta.meta
        self.finish_reason = delta.finish_reason


class TextStream:
    """One choice's text, decoded in the API process (docs/guides/serving.md): the scheduler sends
    token ids, and this incremental detokenizer turns them into text that never splits
    a UTF-8 character. Stop strings are cut exactly where the scheduler cut them (the
    same tokenizer over the same ids finds the same match), and a tail that could still
    become a stop string is held back until it cannot."""

    def __init__(self, tokenizer: Tokenizer | None, job: Job) -> None:
        params = SamplingParams.from_dict(job.params)
        detok = (
            IncrementalDetokenizer(
                tokenizer, job.prompt_ids, skip_special_tokens=params.skip_special_tokens
            )
            if tokenizer is not None
            else None
        )
        self.checker = StopChecker(params.stop_strings, detok)

    def step(self, ids: list[int], finish: dict[str, Any] | None) -> str:
        """The new text for ``ids``; ``finish`` is the chunk's finish reason."""
        checker = self.checker
        if finish is None:
            checker.feed(ids)
        elif finish.get("type") == "stop" and isinstance(finish.get("matched"), int):
            checker.feed(ids[:-1])  # the stop token itself is not text
            checker.finish_text()
        else:
            checker.feed(ids)
            checker.finish_text()
        return checker.take_new_text(final=finish is not None)


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SchedulerUnavailable):
        return APIError(str(exc), status=503)
    if isinstance(exc, RequestFailed):
        return APIError(str(exc), status=400 if exc.invalid else 500)
    # Never echo an unexpected exception's text to a client: it names internals.
    error_id = uuid.uuid4().hex
    log.error("generation failed (id %s)", error_id, exc_info=exc)
    return APIError(
        f"generation failed; the server log has the details under id {error_id}", status=500
    )


async def run_jobs(
    client: SchedulerClient, metrics: Metrics, jobs: list[Job], rid: str | None = None
) -> AsyncIterator[Delta]:
    """Merged deltas of all jobs, each with its text and its choice index; raises the
    first failure. Each job runs under a rid of this process's making (``rid`` itself
    for a single job that names one), so the scheduler needs no id map of its own."""
    if not client.alive:
        raise SchedulerUnavailable("the scheduler process is not running")
    base = uuid.uuid4().hex
    wire = [
        {
            "rid": rid if rid is not None and len(jobs) == 1 else f"{base}-{job.index}",
            "input_ids": job.prompt_ids,
            "params": job.params,
            "return_logprob": job.return_logprob,
            "top_logprobs_num": job.top_logprobs_num,
            "logprob_start_len": job.logprob_start_len,
        }
        for job in jobs
    ]
    for entry, job in zip(wire, jobs, strict=True):
        if job.bootstrap is not None:
            entry["bootstrap"] = job.bootstrap
    texts = [TextStream(client.tokenizer, job) for job in jobs]
    start = time.perf_counter()
    last = [start] * len(jobs)
    counts = [0] * len(jobs)
    metrics.inflight.inc()
    try:
        async with contextlib.aclosing(client.stream(wire)) as deltas:
            async for position, delta in deltas:
                job = jobs[position]
                ids = delta.ids
                finish = delta.meta.get("finish_reason")
                now = time.perf_counter()
                if ids:
                    latency = metrics.itl if counts[position] else metrics.ttft
                    latency.observe(now - last[position])
                    last[position] = now
                    counts[position] += len(ids)
                if finish is not None:
                    metrics.e2e.observe(now - start)
                delta.index = job.index
                delta.text = texts[position].step(ids, finish)
                delta.meta = {
                    "id": wire[position]["rid"],
                    "finish_reason": finish,
                    "prompt_tokens": len(job.prompt_ids),
                    "completion_tokens": counts[position],
                    **delta.meta,
                }
                yield delta
    finally:
        metrics.inflight.dec()


async def collect(
    client: SchedulerClient,
    metrics: Metrics,
    jobs: list[Job],
    request: Request,
    rid: str | None = None,
) -> list[Choice]:
    """Run to completion, aborting everything if the client disconnects meanwhile."""
    choices = {job.index: Choice(job.index) for job in jobs}

    async def gather() -> None:
        async with contextlib.aclosing(run_jobs(client, metrics, jobs, rid)) as deltas:
            async for delta in deltas:
                choices[delta.index].add(delta)

    task = asyncio.create_task(gather())
    gone = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            # The client left: closing the jobs' iterator aborts them all at once.
            await cancel_and_wait(task)
            raise APIError("the client disconnected", status=499)
        try:
            task.result()
        except Exception as exc:  # noqa: BLE001 - mapped to an HTTP status
            raise as_api_error(exc) from None
    finally:
        await cancel_and_wait(gone)
        if not task.done():
            await cancel_and_wait(task)
    return [choices[i] for i in sorted(choices)]


async def first_then_rest(
    deltas: AsyncIterator[Delta],
) -> tuple[Delta | None, AsyncIterator[Delta]]:
    """Wait for the first delta before answering 200, so that a request the scheduler
    rejects still gets a proper 4xx instead of a broken stream."""
    try:
        first = await anext(deltas)
    except StopAsyncIteration:
        return None, deltas
    except Exception as exc:  # noqa: BLE001
        await deltas.aclose()  # type: ignore[attr-defined]
        raise as_api_error(exc) from None
    return first, deltas


async def with_first(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """``first`` (taken by ``first_then_rest``) followed by the rest; closing this
    closes ``rest`` too, which aborts the jobs behind it."""
    try:
        if first is not None:
            yield first
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has really stopped, whatever it raised."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
        await task
