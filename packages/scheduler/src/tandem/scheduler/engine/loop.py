"""The loop thread: runs the scheduler and hands each step's output to its waiters.

Callers talk to it through an inbox (add, abort, flush, stop), which it drains between
steps; it blocks on the inbox only when the scheduler has no work. When a request wakes
an idle loop, the loop holds its first step for the admission window, so that requests
sent together, which reach it a few milliseconds apart, are prefilled as one batch. If
the loop dies, every waiter gets the exception and later calls are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from tandem.scheduler.engine.delivery import Chunk, Delta, Outbox, Waiter, put_all
from tandem.scheduler.messages import Update
from tandem.scheduler.request import Request
from tandem.scheduler.schedule.scheduler import Scheduler

log = logging.getLogger(__name__)

_PEER_POLL_S = 0.05
"""Longest sleep of a loop waiting only for a disaggregation peer (its timeouts)."""

_FLUSH_DRAIN_ITERATIONS = 8
"""Iterations a flush may run to settle the batches still in flight for finished requests
(one or two in practice) before it gives up."""

ADMISSION_WINDOW_SPAN = 4
"""The admission window closes at this many windows after the request that woke the loop,
however many requests keep arriving."""


class EngineLoop:
    """The scheduler's thread and the waiters of the requests it runs."""

    def __init__(
        self, scheduler: Scheduler, *, speculative: bool, admission_window_s: float = 0.0
    ) -> None:
        self.scheduler = scheduler
        self.speculative = speculative
        self.admission_window_s = admission_window_s
        """How long an idle loop, woken by a request, waits for the next before its
        first step (each arrival waits again, up to ``ADMISSION_WINDOW_SPAN`` windows
        in all); 0 steps at once."""
        self.waiters: dict[str, Waiter] = {}
        """Waiters by request id, until the request finishes."""
        self.failure: BaseException | None = None
        """What killed the loop, if it died."""
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tandem-scheduler", daemon=True)
        self._thread.start()

    def add(self, waiter: Waiter) -> None:
        """Queue ``waiter``'s request; its chunks go to ``waiter``."""
        self.waiters[waiter.req.rid] = waiter
        self._inbox.put(("add", waiter.req))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        """Empty the radix cache once the loop reaches it in the inbox, if no request is
        queued or running then; ``False`` otherwise."""
        done: Future[bool] = Future()
        self._inbox.put(("flush", done))
        while True:
            try:
                return done.result(timeout=0.1)
            except TimeoutError:
                if not self._thread.is_alive():
                    raise RuntimeError("the scheduler loop is not running") from self.failure

    def stop(self) -> None:
        """Stop the thread; pending requests end with an error."""
        self._inbox.put(("stop", None))
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                block = not self.scheduler.has_work()
                # Waiting only for a disaggregation peer: its events wake the loop.
                timeout = _PEER_POLL_S if not block and self.scheduler.waits_on_peers() else None
                if not self._drain_inbox(block or timeout is not None, timeout):
                    break
                if block and self.scheduler.has_work() and not self._admission_window():
                    break
                self._deliver(self.scheduler.iterate())
        except BaseException as exc:
            log.exception("scheduler loop failed")
            self.failure = exc
            for waiter in list(self.waiters.values()):
                waiter.put(exc)
        finally:
            self.scheduler.abandon_masks()  # a forward waiting for them would never end
            for waiter in list(self.waiters.values()):
                waiter.put(RuntimeError("the engine shut down before the request finished"))
            self.waiters.clear()

    def wake(self) -> None:
        """Look at the scheduler now (a disaggregation peer said something)."""
        self._inbox.put(("wake", None))

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> bool:
        """Move new requests into the scheduler; ``False`` when asked to stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if not self._take(kind, item):
                return False

    def _admission_window(self) -> bool:
        """An idle loop was woken by a request: take what arrives until no request has
        come for a window (at most ``ADMISSION_WINDOW_SPAN`` windows), so that a burst's
        requests are prefilled together rather than the first alone and the rest after
        it. Other messages (aborts, wakes) are taken but do not hold the window open.
        ``False`` when asked to stop."""
        window = self.admission_window_s
        if window <= 0:
            return True
        now = time.monotonic()
        close, quiet = now + window * ADMISSION_WINDOW_SPAN, now + window
        while (left := min(close, quiet) - time.monotonic()) > 0:
            try:
                kind, item = self._inbox.get(timeout=left)
            except queue.Empty:
                return True
            if not self._take(kind, item):
                return False
            if kind == "add":
                quiet = time.monotonic() + window
        return self._drain_inbox(block=False)

    def _take(self, kind: str, item: Any) -> bool:
        """Act on one inbox message; ``False`` for stop."""
        if kind == "stop":
            return False
        if kind == "add":
            self.scheduler.add(item)
        elif kind == "abort":
            self.scheduler.abort(item)
        elif kind == "flush":
            try:
                item.set_result(self._flush())
            except BaseException as exc:
                item.set_exception(exc)
                raise
        return True

    def _flush(self) -> bool:
        """The radix cache emptied at idle. What remains of finished requests (a batch in
        flight, rows waiting for it) is run to the end first, so a flush right after the
        last answer does not fail on it; a request queued or running refuses it."""
        scheduler = self.scheduler
        for _ in range(_FLUSH_DRAIN_ITERATIONS):
            if scheduler.has_requests():
                return False
            if not scheduler.has_work():
                return scheduler.flush_cache()
            self._deliver(scheduler.iterate())
        return False

    def _deliver(self, updates: list[Update]) -> None:
        """Hand a step's chunks to their consumers: straight into thread queues, and
        to each asyncio loop in one call, so a step wakes a loop once rather than once
        per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Waiter, Chunk]]] = {}
        by_outbox: dict[int, tuple[Outbox, list[Delta]]] = {}
        for update in updates:
            waiter = self.waiters.get(update.req.rid)
            if waiter is None:
                continue
            if waiter.outbox is not None:
                delta = self._delta(waiter, update)
                if delta is not None:
                    by_outbox.setdefault(id(waiter.outbox), (waiter.outbox, []))[1].append(delta)
                continue
            chunk = self._chunk(waiter, update)
            if chunk is None:
                continue
            if waiter.loop is None:
                waiter.chunks.put(chunk)
            else:
                by_loop.setdefault(waiter.loop, []).append((waiter, chunk))
        for outbox, deltas in by_outbox.values():
            outbox.send(deltas)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:
                # The consumers' event loop is closed: nobody is left to read these
                # streams, so stop their requests as a disconnect would.
                for waiter, _ in items:
                    self.waiters.pop(waiter.req.rid, None)
                    self.scheduler.abort(waiter.req.rid)

    def _chunk(self, waiter: Waiter, update: Update) -> Chunk | None:
        req = update.req
        if not (waiter.stream or update.finished):
            return None
        chunk = {
            "text": req.stop.take_new_text(final=update.finished),
            # A stream's chunk holds the step's ids; a final result all of them.
            "output_ids": list(update.new_ids if waiter.stream else req.output_ids),
            "meta_info": self._meta(req, waiter),
        }
        if update.finished:
            del self.waiters[req.rid]
        return chunk

    def _delta(self, waiter: Waiter, update: Update) -> Delta | None:
        """What an outbox gets of ``update``: the new ids and only the new logprobs."""
        req = update.req
        if not update.new_ids and not update.finished:
            return None
        delta = Delta(req.rid, list(update.new_ids))
        meta: dict[str, Any] = {"cached_tokens": req.cached_tokens}
        if req.return_logprob:
            start, waiter.sent_logprobs = waiter.sent_logprobs, len(req.output_logprobs)
            delta.logprobs = [
                [lp, tok]
                for lp, tok in zip(
                    req.output_logprobs[start:], req.output_ids[start:], strict=False
                )
            ]
            if req.top_logprobs_num:
                delta.top_logprobs = [
                    [[lp, tok] for lp, tok in step] for step in req.output_top_logprobs[start:]
                ]
            if req.wants_input_logprobs and not waiter.sent_input_logprobs:
                # All at once, on the first delta: the step that samples the first token
                # computed the last of them.
                waiter.sent_input_logprobs = True
                delta.input_logprobs = [[lp, tok] for lp, tok in _input_pairs(req)]
                if req.top_logprobs_num:
                    delta.input_top_logprobs = [
                        None if step is None else [[lp, tok] for lp, tok in step]
                        for step in req.input_top_logprobs
                    ]
        if update.finished:
            del self.waiters[req.rid]
            meta.update(
                finish_reason=req.finish.as_dict() if req.finish else None,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
            )
            if self.speculative:
                meta["spec_verify_ct"] = req.spec_verify_ct
        delta.meta = meta
        return delta

    def _meta(self, req: Request, waiter: Waiter) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish.as_dict() if req.finish else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if req.token_times is not None:
            meta["output_token_times"] = list(req.token_times)
        if self.speculative:
            meta["spec_verify_ct"] = req.spec_verify_ct
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                (lp, tok, None)
                for lp, tok in zip(req.output_logprobs, req.output_ids, strict=False)
            ]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [(lp, tok, None) for lp, tok in step] for step in req.output_top_logprobs
                ]
            if req.wants_input_logprobs:
                meta.update(self._input_meta(req, waiter))
        return meta

    @staticmethod
    def _input_meta(req: Request, waiter: Waiter) -> dict[str, Any]:
        """``meta_info``'s prompt logprobs, built once they are all in (a stream's chunks
        then share them rather than rebuilding a prompt's worth per chunk)."""
        if waiter.input_meta is not None:
            return waiter.input_meta
        meta: dict[str, Any] = {
            "input_token_logprobs": [(lp, tok, None) for lp, tok in _input_pairs(req)]
        }
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [
                None if step is None else [(lp, tok, None) for lp, tok in step]
                for step in req.input_top_logprobs
            ]
        if req.input_logprobs_done:
            waiter.input_meta = meta
        return meta


def _input_pairs(req: Request) -> list[tuple[float | None, int]]:
    """``req``'s prompt logprobs received so far, each with the prompt token it scores
    (from ``logprob_start_len`` on; ``None`` for the first prompt token)."""
    tokens = req.prompt_ids[req.logprob_start_len :]
    return list(zip(req.input_logprobs, tokens, strict=False))
