"""The scheduler process: owns the ``Engine`` and nothing else.

The device loop lives apart from the HTTP event loop so that a slow tokenizer, JSON or
a burst of clients never delays a forward, and so that a crashed engine cannot take
the API process with it. Requests arrive named by the API process's ids; each step's
output for all of them leaves as one message, sent by the engine's loop thread on a
socket of its own (a ZMQ socket is used by one thread only). The main thread reads
the inbox and sends a heartbeat with the engine's figures a few times a second.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

import zmq

from tandem.scheduler.disagg import Bootstrap
from tandem.scheduler.engine.delivery import Delta
from tandem.scheduler.engine.gc_freeze import freeze_long_lived
from tandem.server import protocol

log = logging.getLogger(__name__)

_INFO_PERIOD_S = 0.25
_POLL_MS = 50


class StepSender:
    """The engine's outbox: one ``STEP`` message per step, on the loop thread."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock

    def send(self, deltas: list[Delta]) -> None:
        out = [delta.wire() for delta in deltas]
        self.sock.send(protocol.encode({"type": protocol.STEP, "out": out}))

    def fail(self, rid: str, error: BaseException) -> None:
        log.error("request %s failed: %s", rid, error)
        message = {"type": protocol.ERROR, "rids": [rid], "message": "generation failed"}
        self.sock.send(protocol.encode({**message, "invalid": False}))


def _push(ctx: zmq.Context[zmq.Socket[bytes]], addr: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(addr)
    return sock


def run(engine_kwargs: dict[str, Any], in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Entry point of the spawned process; returns when told to stop or orphaned."""
    # Ctrl+C, or a supervisor's SIGTERM, reaches the whole process group; the API process
    # drains first and then decides how we stop (STOP, else SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = _push(ctx, out_addr)  # this thread's: ready, info, rejections
    steps = _push(ctx, out_addr)  # the engine loop thread's
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(in_addr)
    engine = None
    try:
        from tandem.scheduler import Engine

        engine = Engine(**engine_kwargs)
    except Exception as exc:  # reported to the API process, which exits
        log.exception("the engine failed to start")
        push.send(protocol.encode({"type": protocol.FATAL, "message": f"{exc}"}))
    if engine is None:
        for sock in (push, steps, pull):
            sock.close()
        ctx.term()
        sys.exit(1)
    outbox = StepSender(steps)
    frozen = freeze_long_lived()
    push.send(protocol.encode({"type": protocol.READY, "info": _info(engine, frozen)}))
    last_info = 0.0
    failed = False
    try:
        while os.getppid() == parent_pid:  # the API process is gone: never outlive it
            if pull.poll(_POLL_MS):
                msg = protocol.decode(pull.recv())
                kind = msg.get("type")
                if kind == protocol.STOP:
                    break
                if kind == protocol.ADD:
                    _add(engine, msg, outbox, push)
                elif kind == protocol.ABORT:
                    for rid in msg["rids"]:
                        engine.abort(rid)
                elif kind == protocol.FLUSH_CACHE:
                    _flush_cache(engine, msg, push)
            if engine.failure is not None:  # a tensor-parallel rank exited, say
                log.error("the engine failed: %s", engine.failure)
                push.send(protocol.encode({"type": protocol.FATAL, "message": engine.failure}))
                failed = True
                break
            now = time.monotonic()
            if now - last_info >= _INFO_PERIOD_S:
                push.send(protocol.encode({"type": protocol.INFO, "info": _info(engine, frozen)}))
                last_info = now
    finally:
        engine.shutdown()  # joins the loop thread: nothing uses ``steps`` after this
        for sock in (push, steps, pull):
            sock.close()
        ctx.term()
    if failed:
        sys.exit(1)


def _add(engine: Any, msg: dict[str, Any], outbox: StepSender, push: zmq.Socket[bytes]) -> None:
    jobs = msg["jobs"]
    rids = [job["rid"] for job in jobs]
    try:
        engine.add_requests(
            input_ids=[job["input_ids"] for job in jobs],
            sampling_params=[job["params"] for job in jobs],
            rids=rids,
            outbox=outbox,
            return_logprob=[bool(job.get("return_logprob")) for job in jobs],
            top_logprobs_num=[int(job.get("top_logprobs_num") or 0) for job in jobs],
            logprob_start_len=[_start(job.get("logprob_start_len")) for job in jobs],
            bootstrap=[_bootstrap(job.get("bootstrap")) for job in jobs],
        )
    except ValueError as exc:
        reply = {"type": protocol.ERROR, "rids": rids, "message": str(exc), "invalid": True}
        push.send(protocol.encode(reply))
    except RuntimeError as exc:  # the engine is shut down or its loop died
        log.error("refused %d requests: %s", len(rids), exc)
        reply = {"type": protocol.ERROR, "rids": rids, "message": "the engine stopped"}
        push.send(protocol.encode({**reply, "invalid": False}))


def _start(value: Any) -> int:
    """A job's ``logprob_start_len`` (checked by the API process); absent is -1."""
    return -1 if value is None else int(value)


def _bootstrap(fields: dict[str, Any] | None) -> Bootstrap | None:
    """A job's bootstrap fields (checked by the API process) as the engine's type."""
    if not fields:
        return None
    return Bootstrap(str(fields["host"]), int(fields["port"]), int(fields["room"]))


def _flush_cache(engine: Any, msg: dict[str, Any], push: zmq.Socket[bytes]) -> None:
    reply: dict[str, Any] = {"type": protocol.FLUSHED, "id": msg["id"], "flushed": False}
    try:
        reply["flushed"] = bool(engine.flush_cache())
    except RuntimeError as exc:  # the engine is shut down or its loop died
        log.error("flush_cache failed: %s", exc)
        reply["error"] = "the engine stopped"
    push.send(protocol.encode(reply))


def _info(engine: Any, gc_frozen: int) -> dict[str, Any]:
    info = dict(engine.get_server_info())
    info["gc_frozen_objects"] = gc_frozen
    info["vocab_size"] = engine.model_config.vocab_size
    info["scheduler_pid"] = os.getpid()
    return {k: v for k, v in info.items() if v is None or isinstance(v, str | int | float | bool)}
