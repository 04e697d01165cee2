"""The control channel between a prefill and a decode server: JSON lines over TCP.

A prefill server runs a ``BootstrapServer`` on ``disaggregation_bootstrap_port``; a
decode server dials it once per prefill server (``BootstrapClient``) and keeps the
connection. Only who is who and where the pages are go over this channel; the KV moves
over the transfer engine (``transfer``). Messages are dicts with an ``op`` (listed at
``Message``). Both ends hand what they receive to the scheduler thread as ``PeerEvent``s
through a queue, and call ``wake`` so an idle loop looks at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Messages, each a dict with an ``op``:
# - decode -> prefill: ``hello`` (its KV layout, transfer backend and endpoint; first on
#   every connection), ``want`` (a room's destination pages), ``cancel`` (a room given up)
# - prefill -> decode: ``welcome`` or ``refuse`` (the answer to ``hello``), ``sending``
#   (the runs of a room's pages about to be written), ``done`` (a room's KV was written;
#   its first token), ``failed`` (a room will get nothing)
Message = dict[str, Any]
_MAX_LINE = 64 << 20  # a want's page list for a very long prompt stays far below this


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """Something the peer said (``op`` of its message), or ``lost`` with a reason."""

    op: str
    peer: Any  # the prefill side's ``Peer``, or the decode side's ``(host, port)``
    message: Message = field(default_factory=dict)


class Inbox:
    """Events for the scheduler thread, with the loop's wake-up call."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._events: queue.Queue[PeerEvent] = queue.Queue()
        self.wake = wake

    def put(self, event: PeerEvent) -> None:
        self._events.put(event)
        self.wake()

    def drain(self) -> list[PeerEvent]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out


class _Line:
    """One socket, read and written as JSON lines (writes from any thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._lock = threading.Lock()

    def send(self, message: Message) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self.sock.sendall(data)

    def receive(self) -> Message | None:
        """The next message, or None at the end of the stream."""
        line = self._reader.readline(_MAX_LINE)
        if not line:
            return None
        if not line.endswith(b"\n"):
            raise ValueError("a bootstrap message longer than the limit")
        message = json.loads(line)
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise ValueError(f"not a bootstrap message: {line[:80]!r}")
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class Peer:
    """A decode server connected to this prefill server."""

    def __init__(self, line: _Line, address: str) -> None:
        self._line = line
        self.address = address  # where it connected from, for messages
        self.endpoint: dict[str, Any] = {}  # its transfer endpoint, from its hello
        self.alive = True

    def send(self, message: Message) -> None:
        """Send, or nothing when the connection is gone (its loss is an event already)."""
        if not self.alive:
            return
        try:
            self._line.send(message)
        except OSError:
            self.alive = False

    def __repr__(self) -> str:
        return f"decode server {self.address}"


class BootstrapServer:
    """The prefill server's side: accepts decode servers, answers their hello itself
    and hands every later message to the scheduler."""

    def __init__(
        self,
        host: str,
        port: int,
        identity: Callable[[Message], str | None],
        welcome: Message,
        inbox: Inbox,
    ) -> None:
        """``identity(hello)`` is ``None`` when the decode server may connect, else why
        not (a different KV layout, another transfer backend); ``welcome`` is what an
        accepted one is told (this side's transfer endpoint)."""
        self._identity = identity
        self._welcome = {**welcome, "op": "welcome"}
        self._inbox = inbox
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = int(self._sock.getsockname()[1])
        self._peers: list[Peer] = []
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="tandem-bootstrap", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return  # closed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = Peer(_Line(sock), f"{addr[0]}:{addr[1]}")
            with self._lock:
                if self._closed:
                    peer._line.close()
                    return
                self._peers.append(peer)
            threading.Thread(
                target=self._serve, args=(peer,), name="tandem-bootstrap-peer", daemon=True
            ).start()

    def _serve(self, peer: Peer) -> None:
        reason = "closed the connection"
        try:
            hello = peer._line.receive()
            if hello is None or hello.get("op") != "hello":
                return  # a probe (the gateway checks the port) or a stranger
            refusal = self._identity(hello)
            if refusal is not None:
                peer.send({"op": "refuse", "message": refusal})
                return
            peer.endpoint = dict(hello.get("endpoint") or {})
            peer.send(self._welcome)
            while True:
                message = peer._line.receive()
                if message is None:
                    break
                self._inbox.put(PeerEvent(message["op"], peer, message))
        except (OSError, ValueError) as exc:
            reason = f"broke the connection ({exc})"
        finally:
            peer.alive = False
            peer._line.close()
            with self._lock:
                if peer in self._peers:
                    self._peers.remove(peer)
            if peer.endpoint:
                self._inbox.put(PeerEvent("lost", peer, {"message": f"{peer} {reason}"}))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._peers)
        with contextlib.suppress(OSError):
            self._sock.close()
        for peer in peers:
            peer._line.close()


class _Connection:
    """The decode server's connection to one prefill server: dialled on its own thread,
    which then reads; messages sent before the welcome wait in order."""

    def __init__(self, client: BootstrapClient, address: tuple[str, int]) -> None:
        self.client = client
        self.address = address
        self.line: _Line | None = None
        self.ready = False
        self.backlog: list[Message] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="tandem-bootstrap-dial", daemon=True).start()

    def send(self, message: Message) -> None:
        with self.lock:
            if not self.ready:
                self.backlog.append(message)
                return
            line = self.line
        assert line is not None
        with contextlib.suppress(OSError):  # the reader reports the loss
            line.send(message)

    def _run(self) -> None:
        host, port = self.address
        reason = "closed the connection"
        try:
            sock = socket.create_connection(self.address, timeout=self.client.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.line = line = _Line(sock)
            line.send({"op": "hello", **self.client.hello})
            answer = line.receive()
            if answer is None:
                raise OSError("closed the connection before answering")
            if answer.get("op") != "welcome":
                reason = f"refused this decode server: {answer.get('message')}"
                return
            sock.settimeout(None)
            self.client.inbox.put(PeerEvent("welcome", self.address, answer))
            with self.lock:
                self.ready = True
                backlog, self.backlog = self.backlog, []
                for message in backlog:
                    line.send(message)
            while True:
                message = line.receive()
                if message is None:
                    break
                self.client.inbox.put(PeerEvent(message["op"], self.address, message))
        except (OSError, ValueError) as exc:
            reason = f"is unreachable or broke the connection ({exc})"
        finally:
            self.client._lost(self)
            if self.line is not None:
                self.line.close()
            self.client.inbox.put(
                PeerEvent(
                    "lost", self.address, {"message": f"prefill server {host}:{port} {reason}"}
                )
            )


class BootstrapClient:
    """The decode server's side: one connection per prefill server, made on first use
    and made again after it is lost."""

    def __init__(self, hello: Message, inbox: Inbox, timeout_s: float) -> None:
        self.hello = hello
        self.inbox = inbox
        self.timeout_s = timeout_s
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._lock = threading.Lock()

    def send(self, address: tuple[str, int], message: Message) -> None:
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = _Connection(self, address)
        conn.send(message)

    def _lost(self, conn: _Connection) -> None:
        with self._lock:
            if self._connections.get(conn.address) is conn:
                del self._connections[conn.address]

    def close(self) -> None:
        with self._lock:
            conns = list(self._connections.values())
            self._connections.clear()
        for conn in conns:
            if conn.line is not None:
                conn.line.close()
