"""A tensor-parallel rank other than 0: runs every step rank 0 launches, on its shard.

Started by rank 0 (or ``start_node``) as ``python -m tandem.scheduler.engine.follower RANK
PARENT_PID`` with the engine's config on stdin, it wires the same parts from the same config
(its shard of the model, pools of the same size, its own FutureMap) but never schedules: it
receives each launched step (``distributed.StepRelay``), launches it on its own
``ModelRunner`` and keeps at most two steps in flight, as rank 0's overlap loop does; grammar
masks follow a step's launch as a message of their own. Every rank thus runs the same steps
in the same order and samples the same ids from the same logits and seeded generators.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.engine.gc_freeze import freeze_long_lived
from tandem.scheduler.engine.wiring import wire
from tandem.scheduler.messages import GrammarMasks, LaunchedBatch
from tandem.scheduler.parallel.distributed import DISCARD, LAUNCH, MASKS, STOP, RankGroup, join
from tandem.scheduler.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

_IN_FLIGHT = 2


def follow(runner: ModelRunner, group: RankGroup) -> None:
    """Run rank 0's steps until it says stop."""
    in_flight: deque[LaunchedBatch] = deque()
    unwritten: dict[int, GrammarMasks] = {}  # launched steps' masks, by step
    while True:
        message = group.receive()
        kind = message[0]
        if kind == LAUNCH:
            _, batch, sampling, new_period = message
            if batch.grammar is not None and not batch.grammar.ready.is_set():
                unwritten[batch.step] = batch.grammar
            in_flight.append(runner.launch(batch, sampling, new_period))
            if len(in_flight) > _IN_FLIGHT:
                in_flight.popleft().wait()
        elif kind == MASKS:
            masks = unwritten.pop(message[1])
            masks.bitmask.copy_(message[2])
            masks.ready.set()
        elif kind == DISCARD:
            runner.discard_rows(message[1])
        elif kind == STOP:
            break
    for launched in in_flight:
        launched.wait()


def _watch_parent(parent_pid: int) -> None:
    """Never outlive the process that started this rank."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    rank, parent_pid = (int(a) for a in (argv if argv is not None else sys.argv[1:]))
    # Ctrl+C reaches the whole process group: rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _watch_parent(parent_pid)
    cfg = EngineConfig.from_options(json.loads(sys.stdin.read()))
    try:
        group = join(cfg, rank)
        parts = wire(cfg, group)
        freeze_long_lived()
        follow(parts.scheduler.runner, group)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        return 1
    parts.stream.synchronize()
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
