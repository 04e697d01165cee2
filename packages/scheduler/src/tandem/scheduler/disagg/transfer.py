"""KV transports: how a prefill server's KV pages reach a decode server's pool.

Both sides register the same ordered list of buffers (every K buffer by layer, then
every V buffer) and exchange ``endpoint``s over the bootstrap channel; the prefill side
``send``s byte regions of its buffers into the peer's, the decode side ``expect``s them.
``mooncake`` (Mooncake's transfer engine over TCP) is one-sided: the prefill side writes
straight into the decode side's registered memory. ``torch`` (torch.distributed
point-to-point, gloo on the CPU, NCCL for CUDA buffers) is two-sided: the decode side
posts one receive per region, in a 2-rank group per (decode, prefill) pair that meets
at a ``TCPStore`` the decode side hosts, with no default process group."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
import traceback
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch

from tandem.futuremap.env import default_library_switch

log = logging.getLogger(__name__)

BACKENDS = ("mooncake", "torch")
KEY_LIMIT = 1 << 31  # keys are torch p2p tags, non-negative int32s


@dataclass(frozen=True, slots=True)
class Region:
    """``length`` bytes at ``offset`` of registered buffer ``buffer``."""

    buffer: int  # index into the registered buffer list
    offset: int  # byte offset in that buffer
    length: int  # bytes


class TransferError(RuntimeError):
    """A transfer that failed or timed out; the message names the peer and what failed."""


class KVTransport(ABC):
    """One side's registered KV buffers and its way of moving regions of them."""

    name: ClassVar[str]

    def __init__(self, buffers: Sequence[torch.Tensor], host: str) -> None:
        if not buffers:
            raise ValueError("a KV transport needs at least one buffer")
        device = buffers[0].device
        for i, buf in enumerate(buffers):
            if not buf.is_contiguous():
                raise ValueError(f"KV buffer {i} is not contiguous")
            if buf.device != device:
                raise ValueError(f"KV buffer {i} is on {buf.device}, buffer 0 on {device}")
            if buf.nbytes == 0:
                raise ValueError(f"KV buffer {i} is empty")
        self.host = host
        self.device = device
        self._buffers = tuple(buffers)
        self._sizes = tuple(buf.nbytes for buf in buffers)
        self._lock = threading.Lock()
        self._closed = False

    @property
    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """JSON-serialisable: what a peer needs to reach this side."""

    @abstractmethod
    def send(
        self,
        peer: Mapping[str, Any],
        key: int,
        src: Sequence[Region],
        dst: Sequence[Region],
        timeout_s: float,
    ) -> None:
        """Prefill side, blocking: copy each ``src`` region of this side's buffers into
        the matching ``dst`` region of ``peer``'s (the decode side's endpoint). A
        ``TransferError`` when it fails or takes longer than ``timeout_s``."""

    @abstractmethod
    def expect(
        self, peer: Mapping[str, Any], key: int, dst: Sequence[Region], timeout_s: float
    ) -> concurrent.futures.Future[None]:
        """Decode side: be ready for ``dst`` regions of this side's buffers to arrive
        from ``peer`` (the prefill side's endpoint) under ``key``. Returns at once; the
        future completes when everything arrived, or fails with ``TransferError``."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads, connections and servers. Idempotent."""

    def _check_send(
        self,
        peer: Mapping[str, Any],
        key: int,
        src: Sequence[Region],
        dst: Sequence[Region],
        timeout_s: float,
    ) -> None:
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source regions for {len(dst)} destination regions")
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            if s.length != d.length:
                raise ValueError(
                    f"region {i}: {s.length} source bytes for {d.length} destination bytes"
                )
        self._check_call(peer, key, timeout_s)
        _check_regions(src, self._sizes, "source")
        sizes = peer.get("sizes")
        if not isinstance(sizes, list):
            raise ValueError(f"the peer endpoint has no buffer sizes: {dict(peer)!r}")
        _check_regions(dst, sizes, "destination")

    def _check_expect(
        self, peer: Mapping[str, Any], key: int, dst: Sequence[Region], timeout_s: float
    ) -> None:
        self._check_call(peer, key, timeout_s)
        _check_regions(dst, self._sizes, "destination")

    def _check_call(self, peer: Mapping[str, Any], key: int, timeout_s: float) -> None:
        if peer.get("backend") != self.name:
            raise ValueError(
                f"the peer endpoint is for backend {peer.get('backend')!r}, this side is "
                f"{self.name!r}"
            )
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < KEY_LIMIT:
            raise ValueError(f"transfer keys are integers in [0, 2**31), got {key!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")


def _check_regions(regions: Sequence[Region], sizes: Sequence[int], what: str) -> None:
    for i, r in enumerate(regions):
        if not 0 <= r.buffer < len(sizes):
            raise ValueError(f"{what} region {i}: no buffer {r.buffer} ({len(sizes)} buffers)")
        if r.offset < 0 or r.length < 0 or r.offset + r.length > sizes[r.buffer]:
            raise ValueError(
                f"{what} region {i}: bytes [{r.offset}, {r.offset + r.length}) are outside "
                f"buffer {r.buffer} ({sizes[r.buffer]} bytes)"
            )


def make_transport(backend: str, buffers: Sequence[torch.Tensor], host: str) -> KVTransport:
    """The ``backend`` transport ("mooncake" or "torch") over ``buffers``, listening on
    and announcing ``host``."""
    if backend == "mooncake":
        return MooncakeTransport(buffers, host)
    if backend == "torch":
        return TorchTransport(buffers, host)
    raise ValueError(f"unknown KV transfer backend {backend!r}; expected one of {BACKENDS}")


# --- Mooncake ---------------------------------------------------------------------


def _mooncake_engine_class() -> Any:
    # Mooncake logs every connection at INFO through glog. MC_LOG_LEVEL, its documented
    # switch, is read once when the engine module loads, so it is set before the import
    # (a level the user chose wins). Errors still show.
    default_library_switch("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            f"the mooncake KV transfer backend needs Mooncake's transfer engine ({e}): "
            "pip install mooncake-transfer-engine-non-cuda (on Debian/Ubuntu it also needs "
            "apt-get install libibverbs1); `--disaggregation-transfer-backend torch` needs "
            "nothing more"
        ) from e
    return TransferEngine


class MooncakeTransport(KVTransport):
    """Mooncake's transfer engine over TCP, peers met by P2P handshake (no metadata
    server). The endpoint carries the engine's session and the buffers' addresses."""

    name = "mooncake"

    def __init__(self, buffers: Sequence[torch.Tensor], host: str) -> None:
        super().__init__(buffers, host)
        engine_class = _mooncake_engine_class()
        if self.device.type != "cpu":
            import mooncake.engine

            if not getattr(mooncake.engine, "SUPPORT_CUDA", False):
                raise RuntimeError(
                    f"the installed Mooncake cannot read {self.device} memory: install "
                    "mooncake-transfer-engine (its CUDA build) or use the torch backend"
                )
        engine = engine_class()
        if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host}")
        self._engine: Any = engine
        self._ptrs = tuple(buf.data_ptr() for buf in self._buffers)
        for i, (ptr, size) in enumerate(zip(self._ptrs, self._sizes, strict=True)):
            if engine.register_memory(ptr, size) != 0:
                raise RuntimeError(f"Mooncake could not register KV buffer {i} ({size} bytes)")
        self._session = f"{host}:{engine.get_rpc_port()}"
        self._writers: set[threading.Thread] = set()

    @property
    def endpoint(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "session": self._session,
            "buffers": list(self._ptrs),
            "sizes": list(self._sizes),
        }

    def send(
        self,
        peer: Mapping[str, Any],
        key: int,
        src: Sequence[Region],
        dst: Sequence[Region],
        timeout_s: float,
    ) -> None:
        self._check_send(peer, key, src, dst, timeout_s)
        session, bases = peer.get("session"), peer.get("buffers")
        if (
            not isinstance(session, str)
            or not isinstance(bases, list)
            or len(bases) != len(peer["sizes"])
        ):
            raise ValueError(f"not a mooncake endpoint: {dict(peer)!r}")
        moves = [(s, d) for s, d in zip(src, dst, strict=True) if s.length]
        if not moves:
            return
        srcs = [self._ptrs[s.buffer] + s.offset for s, _ in moves]
        dsts = [bases[d.buffer] + d.offset for _, d in moves]
        lengths = [s.length for s, _ in moves]
        what = f"KV write of key {key} ({sum(lengths)} bytes) to {session}"
        # The engine's synchronous write has a deadline of its own only (MC_TRANSFER_TIMEOUT,
        # 30 s by default), so it runs on a thread and this one waits at most timeout_s.
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        writer = threading.Thread(
            target=self._write,
            args=(self._engine, self._buffers, session, srcs, dsts, lengths, done),
            name=f"tandem-kv-write-{key}",
            daemon=True,
        )
        with self._lock:
            if self._closed:
                raise TransferError(f"{what}: the transport is closed")
            self._writers.add(writer)
        writer.start()
        try:
            status = done.result(timeout_s)
        except TimeoutError:
            # The write is not cancelled: it may still land, or fail, in the background.
            raise TransferError(f"{what} timed out after {timeout_s:g} s") from None
        if status != 0:
            raise TransferError(
                f"{what} failed (status {status}; Mooncake's log on stderr says why)"
            )

    def _write(
        self,
        engine: Any,
        buffers: tuple[torch.Tensor, ...],  # held so the source memory outlives the write
        session: str,
        srcs: list[int],
        dsts: list[int],
        lengths: list[int],
        done: concurrent.futures.Future[int],
    ) -> None:
        try:
            done.set_result(engine.batch_transfer_sync_write(session, srcs, dsts, lengths))
        except Exception as e:  # noqa: BLE001 - raised in the sending thread
            done.set_exception(e)
        finally:
            with self._lock:
                self._writers.discard(threading.current_thread())

    def expect(
        self, peer: Mapping[str, Any], key: int, dst: Sequence[Region], timeout_s: float
    ) -> concurrent.futures.Future[None]:
        self._check_expect(peer, key, dst, timeout_s)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self._closed:
            future.set_exception(TransferError(f"KV receive of key {key}: the transport is closed"))
        else:
            future.set_result(None)  # one-sided: the peer writes, nothing happens here
        return future

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writers = list(self._writers)
        # A write that timed out may still be running; the engine must outlive it. Each
        # ends by Mooncake's own transfer timeout at the latest.
        for writer in writers:
            writer.join()
        self._engine = None  # its destructor unregisters the memory and stops its threads


# --- torch.distributed point-to-point ---------------------------------------------

_DECODE, _PREFILL = 0, 1  # ranks in a pair's group
_ABORT_TAG = KEY_LIMIT - 1
_STORE_TIMEOUT = timedelta(minutes=5)  # for the host's own store calls, all quick


def _dist() -> Any:
    import torch.distributed

    return torch.distributed


def _new_group(store: Any, rank: int, device: torch.device, host: str, timeout: timedelta) -> Any:
    dist = _dist()

    if device.type == "cuda":
        # Untested here. NCCL ignores tags and matches in posting order, so transfers
        # with one peer must be sent in the order the peer expects them.
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, nccl_options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    options._threads = 1  # its worker threads run collectives only
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _abort(group: Any) -> None:
    """Fail every pending send and receive of ``group``, on both sides."""
    dist = _dist()

    if not isinstance(group, dist.ProcessGroupGloo):
        with contextlib.suppress(RuntimeError):
            group.abort()
        return
    # Gloo cannot cancel a pending wait (Work.abort is not exposed, and closing the
    # group wakes nothing), but a wait that times out closes all of the group's
    # connections and fails every pending operation on both sides. A receive that
    # nobody sends to, with a one-millisecond timeout, is such a wait. (Should a
    # transfer use _ABORT_TAG as its key and be under way, its data ends the receive
    # instead, and the group fails at its waits' timeouts; both outcomes end it.)
    probe = torch.empty(1, dtype=torch.uint8)
    with contextlib.suppress(RuntimeError):
        group.recv([probe], 1 - group.rank(), _ABORT_TAG).wait(timedelta(milliseconds=1))


def _wait_s(deadline: float) -> timedelta:
    # Work.wait treats a zero timeout as "the group's default", never as "now".
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


class _Link:
    """This side's group with one peer, in one role. Any failure discards the link: a
    gloo failure leaves the group unusable, and the next transfer builds a new one."""

    def __init__(self, ident: tuple[int, str], key: str, rank: int, store: Any) -> None:
        self.ident = ident
        self.key = key  # the pair's key prefix in the decode side's store
        self.rank = rank
        self.store = store  # the decode side's store (the prefill side connects lazily)
        self.build = threading.Lock()
        self.group: Any = None
        self.generation: int | None = None
        self.dead = False


class TorchTransport(KVTransport):
    """torch.distributed point-to-point. Every instance hosts a ``TCPStore``: as a
    decode side, its pairs meet there.

    Both sides build a pair's group on their first transfer with the peer and keep it.
    A group that fails (gloo closes all of a group's connections when any wait times
    out) is dropped, and both sides move to the pair's next generation, a counter kept
    in the store; a generation whose rendezvous failed is never reused.
    """

    name = "torch"

    def __init__(self, buffers: Sequence[torch.Tensor], host: str) -> None:
        super().__init__(buffers, host)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the torch KV transport moves CPU or CUDA memory, not {self.device}")
        dist = _dist()

        self._store: Any = dist.TCPStore(
            host, 0, None, True, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
        self._id = uuid.uuid4().hex
        self._port = int(self._store.port)
        self._bytes = tuple(buf.view(torch.uint8).view(-1) for buf in self._buffers)
        self._links: dict[tuple[int, str], _Link] = {}
        self._receivers: set[threading.Thread] = set()
        self._closing = threading.Event()

    @property
    def endpoint(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "id": self._id,
            "host": self.host,
            "store_port": self._port,
            "sizes": list(self._sizes),
        }

    def send(
        self,
        peer: Mapping[str, Any],
        key: int,
        src: Sequence[Region],
        dst: Sequence[Region],
        timeout_s: float,
    ) -> None:
        self._check_send(peer, key, src, dst, timeout_s)
        peer_id = _peer_id(peer, store=True)
        deadline = time.monotonic() + timeout_s
        what = f"KV send of key {key} to {_describe(peer)}"
        if not any(r.length for r in src):
            return
        link, works = self._connect_and_post(
            peer, peer_id, _PREFILL, key, src, deadline, timeout_s, what
        )
        self._finish(link, works, deadline, timeout_s, what)

    def expect(
        self, peer: Mapping[str, Any], key: int, dst: Sequence[Region], timeout_s: float
    ) -> concurrent.futures.Future[None]:
        self._check_expect(peer, key, dst, timeout_s)
        peer_id = _peer_id(peer, store=False)
        deadline = time.monotonic() + timeout_s
        what = f"KV receive of key {key} from {_describe(peer)}"
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        if not any(r.length for r in dst):
            future.set_result(None)
            return future
        with self._lock:
            link = self._links.get((_DECODE, peer_id))
        group = link.group if link is not None else None
        # With the pair's group up, the receives are posted now, so the peer's sends
        # match at once and the thread only waits; otherwise the thread connects first.
        posted: list[tuple[_Link, list[Any]]] = []
        if link is not None and group is not None:
            try:
                posted.append((link, self._post(group, "recv", key, dst)))
            except RuntimeError:
                self._discard(link)
        receiver = threading.Thread(
            target=self._receive,
            args=(dict(peer), peer_id, key, list(dst), deadline, timeout_s, what, posted, future),
            name=f"tandem-kv-receive-{key}",
            daemon=True,
        )
        with self._lock:
            if self._closed:
                future.set_exception(TransferError(f"{what}: the transport is closed"))
                return future
            self._receivers.add(receiver)
        receiver.start()
        return future

    def _receive(
        self,
        peer: Mapping[str, Any],
        peer_id: str,
        key: int,
        dst: list[Region],
        deadline: float,
        timeout_s: float,
        what: str,
        posted: list[tuple[_Link, list[Any]]],
        future: concurrent.futures.Future[None],
    ) -> None:
        # The link and the works live in _wait_for's frame only (``posted`` is emptied):
        # an error's traceback keeps this frame's locals, and works keep the group's
        # connections and threads alive.
        try:
            self._wait_for(
                posted.pop() if posted else None, peer, peer_id, key, dst, deadline, timeout_s, what
            )
        except Exception as e:  # noqa: BLE001 - the future carries it
            future.set_exception(_without_locals(e))
        else:
            future.set_result(None)
        finally:
            with self._lock:
                self._receivers.discard(threading.current_thread())

    def _wait_for(
        self,
        posted: tuple[_Link, list[Any]] | None,
        peer: Mapping[str, Any],
        peer_id: str,
        key: int,
        dst: list[Region],
        deadline: float,
        timeout_s: float,
        what: str,
    ) -> None:
        if posted is None:
            posted = self._connect_and_post(
                peer, peer_id, _DECODE, key, dst, deadline, timeout_s, what
            )
        self._finish(*posted, deadline, timeout_s, what)

    def _connect_and_post(
        self,
        peer: Mapping[str, Any],
        peer_id: str,
        rank: int,
        key: int,
        regions: Sequence[Region],
        deadline: float,
        timeout_s: float,
        what: str,
    ) -> tuple[_Link, list[Any]]:
        op = "send" if rank == _PREFILL else "recv"
        for attempt in (1, 2):
            link, group = self._connect(peer, peer_id, rank, deadline, timeout_s, what)
            try:
                return link, self._post(group, op, key, regions)
            except RuntimeError as e:
                # Nothing was posted: the group was already broken (the peer saw a
                # failure this side has not), so one new group is worth a try.
                error = self._failed(link, e, deadline, timeout_s, what)
                if attempt == 2 or self._closing.is_set():
                    raise error from e
        raise AssertionError("unreachable")

    def _post(self, group: Any, op: str, key: int, regions: Sequence[Region]) -> list[Any]:
        """One send or receive per region, all under tag ``key``: gloo matches a pair's
        operations of one tag in the order they were posted."""
        post = group.send if op == "send" else group.recv
        other = 1 - group.rank()
        return [post([self._view(r)], other, key) for r in regions if r.length]

    def _finish(
        self, link: _Link, works: list[Any], deadline: float, timeout_s: float, what: str
    ) -> None:
        try:
            for work in works:
                if not work.wait(_wait_s(deadline)):
                    raise RuntimeError("the operation was aborted")
        except RuntimeError as e:
            raise self._failed(link, e, deadline, timeout_s, what) from e

    def _failed(
        self, link: _Link, error: Exception, deadline: float, timeout_s: float, what: str
    ) -> TransferError:
        self._discard(link)
        if self._closing.is_set():
            return TransferError(f"{what}: the transport was closed")
        if time.monotonic() >= deadline:
            return TransferError(f"{what} timed out after {timeout_s:g} s")
        return TransferError(f"{what} failed: {error}")

    def _view(self, region: Region) -> torch.Tensor:
        return self._bytes[region.buffer][region.offset : region.offset + region.length]

    def _connect(
        self,
        peer: Mapping[str, Any],
        peer_id: str,
        rank: int,
        deadline: float,
        timeout_s: float,
        what: str,
    ) -> tuple[_Link, Any]:
        """The link to ``peer`` in role ``rank``, and its group (built if need be)."""
        while True:
            link = self._link(peer_id, rank, what)
            if not link.build.acquire(timeout=max(deadline - time.monotonic(), 0)):
                raise TransferError(f"{what} timed out after {timeout_s:g} s (connecting)")
            try:
                if link.dead:
                    continue
                if link.group is None:
                    self._build(link, peer, deadline, timeout_s, what)
                return link, link.group
            finally:
                link.build.release()

    def _link(self, peer_id: str, rank: int, what: str) -> _Link:
        ident = (rank, peer_id)
        with self._lock:
            if self._closed:
                raise TransferError(f"{what}: the transport is closed")
            link = self._links.get(ident)
            if link is None:
                if rank == _DECODE:
                    link = _Link(ident, f"kv/{self._id}/{peer_id}", rank, self._store)
                else:
                    link = _Link(ident, f"kv/{peer_id}/{self._id}", rank, None)
                self._links[ident] = link
            return link

    def _build(
        self, link: _Link, peer: Mapping[str, Any], deadline: float, timeout_s: float, what: str
    ) -> None:
        """Meet the peer at the pair's current generation and build the group there."""
        dist = _dist()

        try:
            if link.store is None:
                link.store = self._client_store(peer, deadline, timeout_s, what)
            store = link.store
            counter = f"{link.key}/generation"
            generation = store.add(counter, 0)
            here = f"{link.key}/{generation}/here"
            store.set(f"{here}/{link.rank}", "1")
            # Wait for the peer here rather than in the group's rendezvous, which close()
            # could not interrupt.
            pause = 0.001
            while not store.check([f"{here}/{1 - link.rank}"]):
                if time.monotonic() >= deadline:
                    _next_generation(store, counter, generation)
                    raise TransferError(
                        f"{what} timed out after {timeout_s:g} s: the peer did not connect"
                    )
                if self._closing.wait(min(pause, max(deadline - time.monotonic(), 0))):
                    raise TransferError(f"{what}: the transport was closed")
                pause = min(2 * pause, 0.05)
                latest = store.add(counter, 0)
                if latest != generation:
                    generation, here = latest, f"{link.key}/{latest}/here"
                    store.set(f"{here}/{link.rank}", "1")
            prefixed = dist.PrefixStore(f"{link.key}/{generation}", store)
            try:
                group = _new_group(prefixed, link.rank, self.device, self.host, _wait_s(deadline))
            except RuntimeError:
                _next_generation(store, counter, generation)
                raise
        except TransferError:
            self._discard(link)
            raise
        except RuntimeError as e:  # torch.distributed's errors (store, gloo) are these
            self._discard(link)
            raise TransferError(f"{what}: could not connect: {e}") from e
        link.group, link.generation = group, generation
        log.debug("KV transport: %s group %s generation %d", self.name, link.key, generation)
        if self._closing.is_set():
            self._discard(link)
            raise TransferError(f"{what}: the transport was closed")

    def _client_store(
        self, peer: Mapping[str, Any], deadline: float, timeout_s: float, what: str
    ) -> Any:
        dist = _dist()

        host, port = peer["host"], peer["store_port"]
        # TCPStore retries a refused connection until its timeout, and then some; a
        # plain connection first makes a peer that is gone fail at once.
        try:
            with socket.create_connection((host, port), max(deadline - time.monotonic(), 0.001)):
                pass
        except OSError as e:
            raise TransferError(f"{what}: cannot reach its store at {host}:{port}: {e}") from e
        return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))

    def _discard(self, link: _Link) -> None:
        with self._lock:
            if self._links.get(link.ident) is link:
                del self._links[link.ident]
        link.dead = True
        group, link.group = link.group, None
        if group is not None:
            _abort(group)
        if link.generation is not None and link.store is not None:
            _next_generation(link.store, f"{link.key}/generation", link.generation)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
            receivers = list(self._receivers)
        self._closing.set()
        for link in links:
            link.dead = True
            group, link.group = link.group, None
            if group is not None:
                _abort(group)
        for receiver in receivers:
            receiver.join()
        for link in links:
            link.store = None
        self._store = None  # its server stops with the last reference


def _without_locals(error: BaseException) -> BaseException:
    """``error`` with the frames of its tracebacks cleared: a failed future can be kept
    long after close(), and the frames' locals would keep the pair's group (and its
    threads) alive."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    return error


def _next_generation(store: Any, counter: str, generation: int) -> None:
    """Move the pair past ``generation`` unless someone already has."""
    with contextlib.suppress(RuntimeError):
        store.compare_set(counter, str(generation), str(generation + 1))


def _peer_id(peer: Mapping[str, Any], store: bool) -> str:
    """The peer's transport id; with ``store``, check that its store can be reached."""
    peer_id = peer.get("id")
    ok = isinstance(peer_id, str) and bool(peer_id)
    if store:
        ok = ok and isinstance(peer.get("host"), str) and isinstance(peer.get("store_port"), int)
    if not ok:
        raise ValueError(f"not a torch endpoint: {dict(peer)!r}")
    return str(peer_id)


def _describe(peer: Mapping[str, Any]) -> str:
    return f"{peer.get('host')}:{peer.get('store_port')} (transport {str(peer.get('id'))[:8]})"
