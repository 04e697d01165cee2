"""The scheduler process: owns the ``Engine`` and nothing else.

The device loop lives apart from the HTTP event loop so that a slow tokenizer, JSON or
a burst of clients never delays a forward, and so that a crashed engine cannot take
the API process with it (the API notices and answers 503 instead of hanging).

Each request runs the engine's public streaming ``generate`` on a thread of its own;
the threads hand their chunks to one sender thread, because a ZMQ socket must only be
used by one thread.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import zmq

from tandem.server import protocol

log = logging.getLogger(__name__)

_INFO_PERIOD_S = 0.25
_POLL_MS = 100


class _Requests:
    """Maps the API's request ids to the engine's, so an abort that arrives before the
    engine named the request (it does so with the first chunk) is still honoured."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine_ids: dict[str, str] = {}
        self._aborted: set[str] = set()

    def named(self, rid: str, engine_id: str) -> bool:
        """Record the engine's id; ``True`` when the request was aborted meanwhile."""
        with self._lock:
            first = rid not in self._engine_ids
            self._engine_ids[rid] = engine_id
            return first and rid in self._aborted

    def abort(self, rid: str) -> str | None:
        with self._lock:
            self._aborted.add(rid)
            return self._engine_ids.get(rid)

    def done(self, rid: str) -> None:
        with self._lock:
            self._engine_ids.pop(rid, None)
            self._aborted.discard(rid)


def _serve_request(
    engine: Any, msg: dict[str, Any], out: queue.Queue[dict[str, Any] | None], reqs: _Requests
) -> None:
    rid = msg["rid"]
    sent_lp = 0
    try:
        chunks = engine.generate(
            input_ids=msg["input_ids"],
            sampling_params=msg["params"],
            stream=True,
            return_logprob=bool(msg.get("return_logprob")),
            top_logprobs_num=int(msg.get("top_logprobs_num") or 0),
        )
    except ValueError as exc:
        out.put({"type": protocol.ERROR, "rid": rid, "message": str(exc), "invalid": True})
        reqs.done(rid)
        return
    try:
        for chunk in chunks:
            meta = dict(chunk["meta_info"])
            if reqs.named(rid, meta["id"]):
                engine.abort(meta["id"])
            # The engine repeats every logprob so far in each chunk; send only the new ones.
            lps = meta.pop("output_token_logprobs", None) or []
            tops = meta.pop("output_top_logprobs", None) or []
            out.put(
                {
                    "type": protocol.CHUNK,
                    "rid": rid,
                    "ids": list(chunk["output_ids"]),
                    "text": chunk["text"],
                    "meta": meta,
                    "logprobs": [list(x) for x in lps[sent_lp:]],
                    "top_logprobs": [[list(t) for t in step] for step in tops[sent_lp:]],
                }
            )
            sent_lp = len(lps)
    except Exception as exc:
        log.exception("request %s failed", rid)
        out.put({"type": protocol.ERROR, "rid": rid, "message": str(exc), "invalid": False})
    finally:
        reqs.done(rid)


def _sender(sock: zmq.Socket[bytes], out: queue.Queue[dict[str, Any] | None]) -> None:
    while True:
        msg = out.get()
        if msg is None:
            return
        sock.send(protocol.encode(msg))


def run(engine_kwargs: dict[str, Any], in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Entry point of the spawned process; returns when told to stop or orphaned."""
    # Ctrl+C reaches the whole process group; the API process decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(out_addr)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(in_addr)
    try:
        from tandem.scheduler import Engine

        engine = Engine(**engine_kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits
        push.send(protocol.encode({"type": protocol.FATAL, "message": f"{exc}"}))
        push.close()
        ctx.term()
        sys.exit(1)
    out: queue.Queue[dict[str, Any] | None] = queue.Queue()
    sender = threading.Thread(target=_sender, args=(push, out), daemon=True)
    sender.start()
    out.put({"type": protocol.READY, "info": _info(engine)})
    reqs = _Requests()
    last_info = 0.0
    try:
        while True:
            if os.getppid() != parent_pid:
                break  # the API process is gone: never outlive it
            if pull.poll(_POLL_MS):
                msg = protocol.decode(pull.recv())
                kind = msg.get("type")
                if kind == protocol.STOP:
                    break
                if kind == protocol.ADD:
                    threading.Thread(
                        target=_serve_request, args=(engine, msg, out, reqs), daemon=True
                    ).start()
                elif kind == protocol.ABORT:
                    engine_id = reqs.abort(msg["rid"])
                    if engine_id is not None:
                        engine.abort(engine_id)
            now = time.monotonic()
            if now - last_info >= _INFO_PERIOD_S:
                out.put({"type": protocol.INFO, "info": _info(engine)})
                last_info = now
    finally:
        engine.shutdown()
        out.put(None)
        sender.join(timeout=2)
        pull.close()
        push.close()
        ctx.term()


def _info(engine: Any) -> dict[str, Any]:
    info = dict(engine.get_server_info())
    info["vocab_size"] = engine.model_config.vocab_size
    info["scheduler_pid"] = os.getpid()
    return {k: v for k, v in info.items() if v is None or isinstance(v, str | int | float | bool)}
