"""Fixtures shared by the server tests: a module's own cache folder (the tiny test
model is built there once per module) and a live ``tandem serve`` of it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_process import LiveServer, live_server


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def server(cache: Path) -> Iterator[LiveServer]:
    with live_server(cache) as live:
        yield live
