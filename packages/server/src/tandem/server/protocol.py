"""The messages between the API process and the scheduler process.

Both sides speak msgpack over two ZMQ PUSH/PULL pipes. The API process binds both
(it outlives the scheduler), the scheduler connects. Keeping the encoding in one
place means the two processes cannot drift apart on framing.
"""

from __future__ import annotations

from typing import Any

import msgpack

# API -> scheduler
# jobs: [{rid, input_ids, params, return_logprob, top_logprobs_num, logprob_start_len,
#         bootstrap?}], all or none;
# bootstrap: {host, port, room} (prefill/decode disaggregation), absent when not given
ADD = "add"
ABORT = "abort"  # rids
STOP = "stop"
FLUSH_CACHE = "flush_cache"  # id: empty the radix cache if idle (answered by FLUSHED)

# scheduler -> API
READY = "ready"  # info
FATAL = "fatal"  # message (the engine could not start, or can no longer run)
STEP = "step"  # out: one step's deltas, one per request with news (streams.Outbox)
ERROR = "error"  # rids, message, invalid (True: the request was bad, not the engine)
INFO = "info"  # info: get_server_info() figures, a few times a second (also the heartbeat)
FLUSHED = "flushed"  # id, flushed (False: requests were queued or running), error if failed


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)  # type: ignore[no-any-return]


def decode(data: bytes) -> dict[str, Any]:
    value = msgpack.unpackb(data, raw=False)
    if not isinstance(value, dict):
        raise ValueError("a message must be a map")
    return value
