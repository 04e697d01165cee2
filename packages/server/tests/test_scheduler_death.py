"""A killed scheduler process turns into errors and 503s, never a hang; SIGTERM leaves
no orphan process."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import live_server, scrape, stream_in_background

KEY = "sk-scheduler-death"  # /get_server_info shows the scheduler's pid only with the key
AUTH = {"Authorization": f"Bearer {KEY}"}


def _scheduler_pid(url: str) -> int:
    info = httpx.get(f"{url}/get_server_info", headers=AUTH, timeout=10).json()
    return int(info["scheduler_pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waits for its parent to reap it; it runs nothing.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_killed_scheduler_fails_requests_and_health(tmp_path: Path) -> None:
    with live_server(tmp_path, "--api-key", KEY) as server:
        pid = _scheduler_pid(server.url)
        reader, lines = stream_in_background(server.url, AUTH)
        time.sleep(1.0)
        before = scrape(server.url, AUTH)
        assert before["tandem_scheduler_up"] == 1
        assert "tandem_num_running_requests" in before
        os.kill(pid, signal.SIGKILL)
        reader.join(timeout=20)
        assert not reader.is_alive(), "the in-flight stream hung"
        assert any('"error"' in line for line in lines)
        time.sleep(0.5)
        assert httpx.get(f"{server.url}/health").status_code == 503
        response = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
            headers=AUTH, timeout=10,
        )  # fmt: skip
        assert response.status_code == 503
        assert "error" in response.json()
        # The dead process's last figures are not reported as if current.
        after = scrape(server.url, AUTH)
        assert after["tandem_scheduler_up"] == 0
        assert "tandem_num_running_requests" not in after
        assert "tandem_kv_used_tokens" not in after


def test_sigterm_leaves_no_orphan(tmp_path: Path) -> None:
    with live_server(tmp_path, "--api-key", KEY) as server:
        pid = _scheduler_pid(server.url)
        server.proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once its graceful shutdown is done.
        assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--page-size", "0"], "--page-size"),
        (["--dtype", "int3"], "--dtype"),
        # Offline only: the server's API process does the text.
        (["--skip-tokenizer-init"], "--skip-tokenizer-init"),
    ],
)
def test_invalid_flag_names_it(flags: list[str], named: str) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "tandem.server.cli", "serve", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert named in done.stderr
