"""The decode server's side: take requests prebuilt by a prefill server.

A request with bootstrap fields waits here (not in the prefill queue) for a row and KV
pages for its whole prompt; its radix-cached prefix is reused and not sent again. Then
its prefill server is asked (``want``) to write the rest of the prompt's K/V into those
pages. When it says ``done`` the request holds its prompt's KV and its first token, as
if a local prefill had run: it receives that token and joins the running requests, and
the next launched batch bootstraps its row into the FutureMap (the table entries, the
first token stashed, the length published) before its first decode step resolves it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.disagg import layout
from tandem.scheduler.disagg.bootstrap import BootstrapClient, Inbox, Message, PeerEvent
from tandem.scheduler.disagg.transfer import KEY_LIMIT, KVTransport
from tandem.scheduler.kv.resources import Resources
from tandem.scheduler.messages import PenaltyReset, ScheduledBatch, StepResult, Update
from tandem.scheduler.request import FinishReason, Request, Stages
from tandem.scheduler.schedule.counters import Counters
from tandem.scheduler.schedule.release import Release

log = logging.getLogger(__name__)


@dataclass
class _Transfer:
    """A request holding its row and pages while its KV comes."""

    req: Request
    address: tuple[str, int]
    key: int
    since: float
    want: Message
    arrived: Future[None] | None = None  # the transport's side of it (``expect``)
    done: Message | None = None  # the prefill server's word that the KV was written


@dataclass
class _Held:
    """An ended request whose pages the prefill server may still be writing."""

    req: Request
    address: tuple[str, int]
    since: float


@dataclass
class DecodeSide:
    """Prebuilt requests from arrival to their first decode step."""

    config: EngineConfig
    stages: Stages
    resources: Resources
    release: Release
    counters: Counters
    transport: KVTransport
    inbox: Inbox
    decoding_pages: Callable[[], int]  # pages to keep for the running requests' next step
    queue: deque[tuple[Request, float]] = field(default_factory=deque)
    transfers: dict[int, _Transfer] = field(default_factory=dict)  # room -> transfer
    held: dict[int, _Held] = field(default_factory=dict)  # room -> ended, pages held
    prebuilt: list[tuple[Request, int]] = field(default_factory=list)  # to bootstrap
    endpoints: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pool = self.resources.kv_pool
        hello = {"layout": layout.identity(pool, self.transport.name)}
        hello["endpoint"] = self.transport.endpoint
        self.timeout_s = float(self.config.disaggregation_timeout)
        self.client = BootstrapClient(hello, self.inbox, self.timeout_s)
        self._keys = itertools.count(1)

    holds_arrivals = True  # a request waits here for its KV, not for a prefill

    def has_work(self) -> bool:
        return bool(self.queue or self.transfers or self.held)

    def add(self, req: Request) -> Update | None:
        room = req.bootstrap.room
        if (
            room in self.transfers
            or room in self.held
            or any(r.bootstrap.room == room for r, _ in self.queue)
        ):
            return self._end(req, f"bootstrap_room {room} is already in use")
        self.queue.append((req, time.monotonic()))
        return None

    def abort(self, rid: str) -> Update | None:
        """End request ``rid`` if it is still here (queued or waiting for its KV)."""
        for item in self.queue:
            if item[0].rid == rid:
                self.queue.remove(item)
                return self._end(item[0], "aborted by the client")
        for room, transfer in self.transfers.items():
            if transfer.req.rid == rid:
                return self._give_up(room, "aborted by the client")
        return None

    # -- each iteration ---------------------------------------------------------------------
    def poll(self) -> list[Update]:
        updates: list[Update] = []
        for event in self.inbox.drain():
            self._on(event, updates)
        now = time.monotonic()
        for room, transfer in list(self.transfers.items()):
            if transfer.done is not None and (transfer.arrived is None or transfer.arrived.done()):
                self._arrived(room, transfer, updates)
            elif now - transfer.since > self.timeout_s:
                why = f"no KV from the prefill server for room {room} within {self.timeout_s:g} s"
                updates.append(self._give_up(room, why))
        for room, item in list(self.held.items()):
            if now - item.since > self.timeout_s:
                log.warning("room %d: no answer from its prefill server, pages freed", room)
                self._free_held(room)
        self._admit(updates, now)
        return updates

    def _on(self, event: PeerEvent, updates: list[Update]) -> None:
        message = event.message
        room = message.get("room")
        if event.op == "welcome":
            self.endpoints[event.peer] = dict(message.get("endpoint") or {})
        elif event.op == "sending" and room in self.transfers:
            self._expect(room, message.get("runs"), updates)
        elif event.op == "done" and room in self.transfers:
            self.transfers[room].done = message
        elif event.op == "failed" and room in self.transfers:
            why = str(message.get("message") or "the prefill server failed the request")
            updates.append(self._fail(room, why))
        elif event.op in ("done", "failed") and room in self.held:
            self._free_held(room)
        elif event.op == "lost":
            self.endpoints.pop(event.peer, None)
            why = str(message.get("message") or "the prefill server is gone")
            for room in [r for r, t in self.transfers.items() if t.address == event.peer]:
                updates.append(self._fail(room, why))
            for room in [r for r, h in self.held.items() if h.address == event.peer]:
                self._free_held(room)

    def _admit(self, updates: list[Update], now: float) -> None:
        """Rows and pages for queued requests, in order, while they fit."""
        res = self.resources
        while self.queue:
            req, since = self.queue[0]
            rows = self.config.max_running_requests - self.stages.admitted()
            prompt = len(req.prompt_ids)
            if rows > 0 and res.admit(req, prompt, self.decoding_pages()):
                self.queue.popleft()
                if not res.reserve(req, prompt):
                    raise RuntimeError(f"admitted request {req.rid} has no KV for its prompt")
                self._ask(req, now)
                continue
            if now - since > self.timeout_s:
                self.queue.popleft()
                why = (
                    f"the decode server is full: no row and KV pages for {prompt} prompt "
                    f"tokens within {self.timeout_s:g} s"
                )
                updates.append(self._end(req, why))
                continue
            return

    def _ask(self, req: Request, now: float) -> None:
        """Ask the prefill server for the prompt's K/V past the cached prefix."""
        boot = req.bootstrap
        size = self.resources.kv_pool.page_size
        cached = req.kv_len  # whole pages from the radix cache
        pages = req.pages[cached // size : self.resources.kv_pool.pages_for(len(req.prompt_ids))]
        key = next(self._keys) % KEY_LIMIT
        want = {
            "op": "want",
            "room": boot.room,
            "key": key,
            "skip": cached,
            "pages": pages,
            "prompt_hash": layout.prompt_hash(req.prompt_ids),
        }
        address = (boot.host, boot.port)
        transfer = _Transfer(req, address, key, now, want)
        self.transfers[boot.room] = transfer
        self.stages.transferring.append(req)
        req.cached_tokens = cached
        self.counters.cached_tokens += cached
        self.client.send(address, want)

    def _expect(self, room: int, runs: Any, updates: list[Update]) -> None:
        """The prefill server is about to write these runs of the room's pages: get the
        transport ready to receive them (a two-sided one posts its receives)."""
        transfer = self.transfers[room]
        pages = transfer.want["pages"]
        mine = set(pages)
        try:
            spans = [(int(first), int(n)) for first, n in runs]
            ok = sum(n for _, n in spans) == len(pages) and all(
                set(range(first, first + n)) <= mine for first, n in spans
            )
        except (TypeError, ValueError):
            ok = False
        if not ok or transfer.address not in self.endpoints:
            updates.append(self._fail(room, f"the prefill server's runs for room {room} are wrong"))
            return
        dst = layout.regions(self.resources.kv_pool, spans)
        endpoint = self.endpoints[transfer.address]
        transfer.arrived = self.transport.expect(endpoint, transfer.key, dst, self.timeout_s)
        transfer.arrived.add_done_callback(lambda _: self.inbox.wake())

    def _arrived(self, room: int, transfer: _Transfer, updates: list[Update]) -> None:
        """The prompt's K/V is here: the request takes its first token and runs."""
        error = transfer.arrived.exception() if transfer.arrived is not None else None
        if error is not None:
            updates.append(self._fail(room, f"the KV of room {room} did not arrive: {error}"))
            return
        done = transfer.done
        assert done is not None
        del self.transfers[room]
        req = transfer.req
        self.stages.transferring.remove(req)
        req.kv_len = len(req.prompt_ids)
        self.counters.prompt_tokens += len(req.prompt_ids)
        req.scheduled_samples = 1
        # Newest admitted: the first to go back to the queue when pages run short.
        req.admit_seq = 1 + max((r.admit_seq for r in self.stages.running), default=0)
        self.stages.running.append(req)
        token = int(done["token"])
        update = self.release.receive(req, [token], _first(done), 0)
        updates.append(update)
        if update.finished:
            self.release.release(req)
        else:
            self.prebuilt.append((req, req.retractions))

    def ended(self, req: Request) -> None:
        pass  # a request leaves this side before it decodes

    def prefilled(self, updates: list[Update]) -> list[Update]:
        return updates

    def attach(self, batch: ScheduledBatch) -> None:
        """Bootstrap the requests that arrived into ``batch``, the next launched: their
        rows point at their prompt's pages, their penalties start from their tokens,
        and the FutureMap holds their first token and length before any resolve."""
        slots = self.resources.kv_pool.slots
        for req, retractions in self.prebuilt:
            if req.row is None or req.retractions != retractions or req not in self.stages.running:
                continue  # retracted or ended meanwhile: it starts over or is gone
            length = len(req.prompt_ids)
            batch.map(req.row, 0, slots(req.pages, 0, length))
            batch.penalty_resets.append(
                PenaltyReset(req.row, req.prompt_ids, list(req.output_ids[:1]), req.params)
            )
            batch.prebuilt_rows.append(req.row)
            batch.prebuilt_tokens.append(req.output_ids[0])
            batch.prebuilt_lens.append(length)
        self.prebuilt.clear()

    # -- endings ----------------------------------------------------------------------------
    def _end(self, req: Request, why: str) -> Update:
        """End a request that holds nothing yet."""
        update = self.release.finish(req, FinishReason.abort(why))
        self.release.release(req)
        return update

    def _fail(self, room: int, why: str) -> Update:
        """The prefill server will write nothing more: end the request, free its pages."""
        transfer = self.transfers.pop(room)
        req = transfer.req
        self.stages.transferring.remove(req)
        log.warning("%s", why)
        update = self.release.finish(req, FinishReason.abort(why))
        self.release.release(req)
        return update

    def _give_up(self, room: int, why: str) -> Update:
        """End the request now; its pages stay held until the prefill server answers the
        cancel (it may be writing them), or a timeout."""
        transfer = self.transfers.pop(room)
        req = transfer.req
        self.stages.transferring.remove(req)
        self.client.send(transfer.address, {"op": "cancel", "room": room, "message": why})
        update = self.release.finish(req, FinishReason.abort(why))
        req.in_flight += 1
        self.held[room] = _Held(req, transfer.address, time.monotonic())
        return update

    def _free_held(self, room: int) -> None:
        req = self.held.pop(room).req
        req.in_flight -= 1
        self.release.release(req)

    def close(self) -> None:
        self.transport.close()
        self.client.close()


def _first(done: Message) -> StepResult:
    """The first token's step result, as the prefill server sampled it."""
    result = StepResult(next_token_ids=torch.tensor([int(done["token"])]))
    if "logprob" in done:
        result.logprobs = torch.tensor([float(done["logprob"])])
    top = done.get("top")
    if top:
        result.top_logprob_values = torch.tensor([[float(v) for v, _ in top]])
        result.top_logprob_ids = torch.tensor([[int(i) for _, i in top]])
    return result
