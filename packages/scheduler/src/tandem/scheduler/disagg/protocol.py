"""What a request carries to be disaggregated, and what the two servers tell each other.

A gateway sends the same request to a prefill and a decode server with the same
``Bootstrap`` (SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``
request fields): the prefill server's bootstrap address and a room number that pairs
the two halves of the request.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOM_LIMIT = 1 << 64  # rooms are unsigned 64-bit numbers (SGLang's gateway draws them so)


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """Where a request's prefill server takes questions, and the room pairing its two
    halves."""

    host: str  # the prefill server's bootstrap host
    port: int  # its bootstrap port (``disaggregation_bootstrap_port``)
    room: int  # the pair's number, unique among the requests in flight

    def check(self) -> None:
        """A ``ValueError`` naming the field that is wrong."""
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"bootstrap_host must be a non-empty string, got {self.host!r}")
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"bootstrap_port must be in [1, 65535], got {port!r}")
        room = self.room
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < ROOM_LIMIT:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**64), got {room!r}")
