"""The tests' ``live_server`` survives losing its port to another process between
choosing it and the server binding it (a CI run once failed that way)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
import server_process


def test_a_taken_port_starts_the_server_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        fresh = server_process.free_port
        monkeypatch.setattr(server_process, "free_port", lambda: next(ports, None) or fresh())
        with server_process.live_server(tmp_path) as live:
            assert live.url != f"http://127.0.0.1:{taken.getsockname()[1]}"
            assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200
