"""The tensor-parallel ranks: starting them, joining them, and rank 0's channel to them.

``tp_size`` ranks, one process each, join one torch.distributed group (``nccl`` on CUDA/ROCm,
``gloo`` on the CPU). Rank 0, the engine's own process, schedules and launches every step;
the others are followers (``tandem.scheduler.engine.follower``) that run each step on their shard.
Collectives use the default group, steps a gloo ``control`` group, so the forward stream's
and the scheduler thread's calls never interleave differently on two ranks. A rank that exits
fails the next collective and rank 0's poll (``RankGroup.failure``) at once; one that hangs
fails the next collective after ``dist_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.messages import SamplingInputs, ScheduledBatch
from tandem.scheduler.models import ModelConfig
from tandem.scheduler.models.source import resolve_model, resolve_tokenizer
from tandem.scheduler.models.tensor_parallel import TensorParallel, check_divisible

log = logging.getLogger(__name__)

_CONTROL_TIMEOUT = timedelta(days=30)
"""How long a follower waits on the control group: as long as rank 0 idles."""
_JOINED = "tandem-joined"
_POLL_S = 0.2


@dataclass
class RankGroup:
    """This process's rank, its collectives, and the ranks it started."""

    tp: TensorParallel
    local_rank: int
    """Its index among the ranks of its machine (its device there)."""
    control: Any
    """The gloo group rank 0's step messages travel on."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    failure: str | None = None
    """Why the group is broken (a started rank exited), once it is."""
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def rank(self) -> int:
        return self.tp.rank

    def send(self, message: tuple[Any, ...]) -> None:
        """Rank 0: ``message`` to every other rank, in order."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> tuple[Any, ...]:
        """A follower: rank 0's next message."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return tuple(box[0])

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (sizes every rank must share)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def watch(self) -> None:
        """Poll the started ranks on a thread; the first to exit sets ``failure``."""
        threading.Thread(target=self._watch, name="tandem-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            dead = self.exited()
            if dead is not None:
                self.failure = dead
                log.error("%s", dead)
                return

    def exited(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return (
                    f"tensor-parallel rank {self.rank + rank} (pid {proc.pid}) exited with "
                    f"code {code}: the engine cannot run without it"
                )
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop watching, wait for the started ranks to exit (they were told to stop),
        kill those that do not, and leave the process group."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


LAUNCH, MASKS, DISCARD, STOP = "launch", "masks", "discard", "stop"
"""The kinds of rank 0's messages: a launched step, the grammar masks of a launched
step (written after its launch), rows whose futures are discarded, the end."""


@dataclass(frozen=True)
class StepRelay:
    """Rank 0's side of the control channel: every step the ``ModelRunner`` launches,
    and every row it discards, goes to the followers in launch order. The batch goes
    without its requests (host state the followers never read); the message is sent
    on the scheduler thread while the device runs the batch before."""

    group: RankGroup

    def launch(
        self, batch: ScheduledBatch, sampling: SamplingInputs | None, new_period: bool
    ) -> None:
        steps = dataclasses.replace(batch, reqs=[], finishing=[])
        self.group.send((LAUNCH, steps, sampling, new_period))

    def masks(self, step: int, bitmask: torch.Tensor) -> None:
        self.group.send((MASKS, step, bitmask))

    def discard(self, rows: list[int]) -> None:
        self.group.send((DISCARD, list(rows)))

    def stop(self) -> None:
        self.group.send((STOP,))


def per_node(cfg: EngineConfig) -> int:
    return cfg.tp_size // cfg.nnodes


def check_ranks(cfg: EngineConfig) -> ModelConfig:
    """Refuse what cannot start, before any rank does: a ``tp_size`` the model's shapes
    do not divide, more ranks on this machine than devices (or cores, on the CPU)."""
    mc = ModelConfig.from_pretrained(resolve_model(cfg.model_path))
    check_divisible(mc, cfg.tp_size)
    local = per_node(cfg)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        cores = os.cpu_count() or 1
        if local > cores:
            raise ValueError(f"tp_size={cfg.tp_size} puts {local} ranks on {cores} CPU cores")
    else:
        devices = torch.cuda.device_count()
        if local > devices:
            raise ValueError(
                f"tp_size={cfg.tp_size} needs {local} devices on this machine; it has {devices}"
            )
    return mc


def with_local_model(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with its model and tokenizer as the local folders they resolve to
    (``models.source``), so that the ranks this machine starts load them as they are
    instead of each downloading or fetching them again."""
    model = resolve_model(cfg.model_path)
    tokenizer = resolve_tokenizer(cfg.tokenizer_path, model) if cfg.tokenizer_path else None
    return dataclasses.replace(
        cfg, model_path=str(model), tokenizer_path=None if tokenizer is None else str(tokenizer)
    )


def rank_device(cfg: EngineConfig, local_rank: int) -> str | None:
    """The device of the rank with index ``local_rank`` on its machine."""
    if cfg.tp_size == 1:
        return cfg.device
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{local_rank}"


def start_rank_zero(cfg: EngineConfig) -> tuple[EngineConfig, RankGroup]:
    """Rank 0: start this machine's other ranks, join the group, and return the
    config every rank runs (with the meeting address filled in)."""
    cfg = with_local_model(cfg)
    check_ranks(cfg)
    if cfg.dist_init_addr is None:
        cfg = dataclasses.replace(cfg, dist_init_addr=f"127.0.0.1:{_free_port()}")
    procs = [_spawn(cfg, rank) for rank in range(1, per_node(cfg))]
    try:
        group = join(cfg, 0, procs)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    group.procs = procs
    group.watch()
    return cfg, group


def start_node(cfg: EngineConfig) -> int:
    """A machine other than rank 0's (``node_rank`` > 0): run its ranks until they
    exit; returns the first non-zero exit code, or 0."""
    cfg = with_local_model(cfg)
    check_ranks(cfg)
    first = cfg.node_rank * per_node(cfg)
    procs = [_spawn(cfg, rank) for rank in range(first, first + per_node(cfg))]
    code = 0
    try:
        for proc in procs:
            code = code or proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code


def join(
    cfg: EngineConfig, rank: int, procs: list[subprocess.Popen[bytes]] | None = None
) -> RankGroup:
    """Join the group at ``cfg.dist_init_addr`` as ``rank``. Rank 0 hosts the meeting
    point and waits for the others while watching ``procs`` (a rank that dies while
    starting is an error at once, not after the timeout); any rank that cannot reach
    the meeting point within ``dist_timeout`` raises, naming the address."""
    assert cfg.dist_init_addr is not None
    host, _, port = cfg.dist_init_addr.rpartition(":")
    timeout = timedelta(seconds=cfg.dist_timeout)
    local = rank % per_node(cfg)
    device = torch.device(rank_device(cfg, local) or "cpu")
    backend = "gloo" if device.type == "cpu" else "nccl"
    if device.type != "cpu":
        torch.cuda.set_device(device)
    try:
        store = dist.TCPStore(
            host, int(port), cfg.tp_size, rank == 0, timeout=timeout, wait_for_workers=False
        )
    except Exception as exc:
        raise RuntimeError(
            f"rank {rank} could not reach dist_init_addr {cfg.dist_init_addr} "
            f"within {cfg.dist_timeout} s: {exc}"
        ) from exc
    store.add(_JOINED, 1)
    if rank == 0:
        _wait_for_ranks(store, cfg, procs or [])
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=cfg.tp_size, timeout=timeout
    )
    # A group's timeout is each rank's own: rank 0's sends give up on a rank that stopped
    # reading after dist_timeout, while the others wait for rank 0 as long as it idles.
    control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else _CONTROL_TIMEOUT)
    return RankGroup(TensorParallel(rank, cfg.tp_size, dist.group.WORLD), local, control)


def _wait_for_ranks(store: Any, cfg: EngineConfig, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + cfg.dist_timeout
    while store.add(_JOINED, 0) < cfg.tp_size:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"a tensor-parallel rank (pid {proc.pid}) exited with code "
                    f"{proc.returncode} while starting"
                )
        if time.monotonic() > deadline:
            joined = store.add(_JOINED, 0)
            raise RuntimeError(
                f"only {joined} of tp_size={cfg.tp_size} ranks reached "
                f"{cfg.dist_init_addr} within {cfg.dist_timeout} s"
            )
        time.sleep(_POLL_S)


def _spawn(cfg: EngineConfig, rank: int) -> subprocess.Popen[bytes]:
    """Start rank ``rank`` as ``python -m tandem.scheduler.engine.follower``; its config goes
    on stdin (no environment, no files)."""
    command = [
        sys.executable,
        "-m",
        "tandem.scheduler.engine.follower",
        str(rank),
        str(os.getpid()),
    ]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(cfg.as_dict()).encode())
    proc.stdin.close()
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
