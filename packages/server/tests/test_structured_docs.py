"""The "Structured outputs and tools" page's Python examples, run in order as one script
against a live server (the embedded default model), as a reader would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from repo_scripts import ROOT
from server_process import live_server

PAGE = ROOT / "docs" / "guides" / "structured-outputs.md"
PAGE_URL = "http://127.0.0.1:30555"  # where the page's examples expect the server


def test_the_pages_python_examples_run(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 5
    script = "\n".join(blocks)
    assert PAGE_URL in script
    with live_server(tmp_path) as server:
        done = subprocess.run(
            [sys.executable, "-c", script.replace(PAGE_URL, server.url)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
