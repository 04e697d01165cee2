"""The prefill server's side: prefill, sample the first token, send the KV and that
token to the decode server that asks for the request's room.

A request runs the usual prefill with one sample. When its step is processed it has
its first token and its K/V is in its pages: it stays held (``in_flight``) and its
final update waits until the pages have been written into the decode server's pages
named by the room's ``want`` (which may come before or after), then the decode server
is told ``done`` with the token. Every way it can go wrong ends the request with an
error and gives its row and pages back.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.disagg import layout
from tandem.scheduler.disagg.bootstrap import BootstrapServer, Inbox, Message, Peer, PeerEvent
from tandem.scheduler.disagg.transfer import KVTransport
from tandem.scheduler.kv.pools import PagedKVPool
from tandem.scheduler.messages import ScheduledBatch, Update
from tandem.scheduler.request import FinishReason, Request
from tandem.scheduler.schedule.release import Release

log = logging.getLogger(__name__)


@dataclass
class _Prefilled:
    """A request whose KV is ready, held until it is sent."""

    req: Request
    update: Update  # its final update, delivered once the hand-over settles
    since: float
    peer: Peer | None = None
    sending: Future[None] | None = None
    cancelled: str = ""  # the decode server gave up while the pages were moving


class PrefillSide:
    """Rooms asked for, requests ready, transfers under way."""

    holds_arrivals = False  # a request prefills in the queue like any other

    def __init__(
        self,
        config: EngineConfig,
        pool: PagedKVPool,
        transport: KVTransport,
        release: Release,
        inbox: Inbox,
    ) -> None:
        self.pool = pool
        self.transport = transport
        self.release = release
        self.inbox = inbox
        self.timeout_s = float(config.disaggregation_timeout)
        self._identity = layout.identity(pool, transport.name)
        self.server = BootstrapServer(
            config.disaggregation_host,
            config.disaggregation_bootstrap_port,
            lambda hello: layout.mismatch(self._identity, hello.get("layout")),
            {"endpoint": transport.endpoint},
            inbox,
        )
        self.wants: dict[int, tuple[Peer, Message, float]] = {}  # room -> ask, before its request
        self.ready: dict[int, _Prefilled] = {}  # room -> held request
        self.gone: dict[int, float] = {}  # rooms whose request ended without KV: answer "failed"
        self.in_use: set[int] = set()  # rooms of requests here, queued to sent
        self._sender = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-kv-send")

    @property
    def port(self) -> int:
        return self.server.port

    def has_work(self) -> bool:
        return bool(self.ready)

    def add(self, req: Request) -> Update | None:
        """A new request: it prefills and samples once. A room already in use here is
        refused (the update that ends it)."""
        room = req.bootstrap.room
        req.max_samples = min(req.max_samples, 1)
        if room in self.in_use:
            update = self.release.finish(
                req, FinishReason.abort(f"bootstrap_room {room} is already in use")
            )
            self.release.release(req)
            return update
        self.in_use.add(room)
        return None

    def abort(self, rid: str) -> Update | None:
        return None  # nothing waits here before its prefill

    def attach(self, batch: ScheduledBatch) -> None:
        pass

    def prefilled(self, updates: list[Update]) -> list[Update]:
        """Hold the updates of requests that just received their first token (their
        KV is complete); the rest pass."""
        out = []
        for update in updates:
            req = update.req
            if req.bootstrap is None or not update.finished:
                out.append(update)
                continue
            if req.finish.kind == "abort" or not req.output_ids:
                self.ended(req)
                out.append(update)
                continue
            req.in_flight += 1  # the pages are read by the transfer until it settles
            room = req.bootstrap.room
            self.ready[room] = _Prefilled(req, update, time.monotonic())
            want = self.wants.pop(room, None)
            if want is not None:
                self._send(room, want[0], want[1])
        return out

    def ended(self, req: Request) -> None:
        """``req`` ended before its KV was ready (aborted): its decode server hears so."""
        room = req.bootstrap.room
        self.in_use.discard(room)
        message = f"the request of room {room} ended on the prefill server: {_why(req)}"
        want = self.wants.pop(room, None)
        if want is not None:
            want[0].send({"op": "failed", "room": room, "message": message})
        else:
            self.gone[room] = time.monotonic()

    def poll(self) -> list[Update]:
        updates: list[Update] = []
        for event in self.inbox.drain():
            self._on(event, updates)
        now = time.monotonic()
        for room, item in list(self.ready.items()):
            if item.sending is not None and item.sending.done():
                self._sent(room, item, updates)
            elif item.sending is None and now - item.since > self.timeout_s:
                why = f"no decode server asked for room {room} within {self.timeout_s:g} s"
                self._settle(room, item, why, updates)
        for room, (peer, _, since) in list(self.wants.items()):
            if now - since > self.timeout_s:
                del self.wants[room]
                why = (
                    f"the prefill server got no request for room {room} within {self.timeout_s:g} s"
                )
                peer.send({"op": "failed", "room": room, "message": why})
        for room, since in list(self.gone.items()):
            if now - since > self.timeout_s:
                del self.gone[room]
        return updates

    def _on(self, event: PeerEvent, updates: list[Update]) -> None:
        message, peer = event.message, event.peer
        room = message.get("room")
        if event.op == "want" and isinstance(room, int):
            if room in self.gone:
                del self.gone[room]
                why = f"the request of room {room} ended on the prefill server before its KV"
                peer.send({"op": "failed", "room": room, "message": why})
            elif room in self.ready and self.ready[room].sending is None:
                self._send(room, peer, message)
            else:
                self.wants[room] = (peer, message, time.monotonic())
        elif event.op == "cancel" and isinstance(room, int):
            self.wants.pop(room, None)
            item = self.ready.get(room)
            why = str(message.get("message") or "cancelled by the decode server")
            if item is not None and item.sending is None:
                self._settle(room, item, why, updates)
            elif item is not None:
                item.cancelled = why
        elif event.op == "lost":
            for room, want in list(self.wants.items()):
                if want[0] is peer:
                    del self.wants[room]

    def _send(self, room: int, peer: Peer, want: Message) -> None:
        """Check the decode server's pages against the request, then move the K/V."""
        item = self.ready[room]
        item.peer = peer
        req = item.req
        size = self.pool.page_size
        skip, pages = want.get("skip"), want.get("pages")
        total = self.pool.pages_for(len(req.prompt_ids))
        problem = None
        if want.get("prompt_hash") != layout.prompt_hash(req.prompt_ids):
            problem = "the two servers tokenized the prompt differently"
        elif not isinstance(skip, int) or skip % size or not 0 <= skip < len(req.prompt_ids):
            problem = f"bad skip {skip!r}"
        elif not isinstance(pages, list) or len(pages) != total - skip // size:
            problem = f"{pages!r:.40} is not {total - skip // size} page numbers"
        elif not isinstance(want.get("key"), int):
            problem = "no transfer key"
        if problem is not None:
            item.sending = _failed(f"the decode server's want for room {room} is wrong: {problem}")
            return
        runs = layout.runs(req.pages[skip // size : total], pages)
        src = layout.regions(self.pool, [(s, n) for s, _, n in runs])
        dst = layout.regions(self.pool, [(d, n) for _, d, n in runs])
        peer.send({"op": "sending", "room": room, "runs": [[d, n] for _, d, n in runs]})
        item.sending = self._sender.submit(
            self.transport.send, peer.endpoint, want["key"], src, dst, self.timeout_s
        )
        item.sending.add_done_callback(lambda _: self.inbox.wake())

    def _sent(self, room: int, item: _Prefilled, updates: list[Update]) -> None:
        assert item.sending is not None
        assert item.peer is not None
        error = item.sending.exception()
        if error is None and not item.cancelled:
            req = item.req
            done: dict[str, Any] = {"op": "done", "room": room, "token": req.output_ids[0]}
            if req.output_logprobs:
                done["logprob"] = req.output_logprobs[0]
            if req.output_top_logprobs:
                done["top"] = req.output_top_logprobs[0]
            item.peer.send(done)
            self._settle(room, item, None, updates)
            return
        why = item.cancelled or f"the KV transfer of room {room} failed: {error}"
        item.peer.send({"op": "failed", "room": room, "message": why})
        self._settle(room, item, why, updates)

    def _settle(
        self, room: int, item: _Prefilled, error: str | None, updates: list[Update]
    ) -> None:
        """The hand-over is over: the request's final update goes out (an error when
        ``error``) and its row and pages come back."""
        del self.ready[room]
        self.in_use.discard(room)
        req = item.req
        if error is not None:
            log.warning("%s", error)
            req.finish = FinishReason.abort(error)
            self.release.counters.aborted_requests += 1
        req.in_flight -= 1
        self.release.release(req)
        updates.append(item.update)

    def close(self) -> None:
        self.transport.close()
        self.server.close()
        self._sender.shutdown(wait=False, cancel_futures=True)


def _why(req: Request) -> str:
    finish = req.finish
    return finish.message or finish.kind if finish is not None else "unknown"


def _failed(message: str) -> Future[None]:
    future: Future[None] = Future()
    future.set_exception(RuntimeError(message))
    return future
