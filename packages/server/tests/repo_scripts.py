"""The repository's files outside the packages (tools, the docs site's hooks, the asv
benchmarks), loaded as modules for the tests that check them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]
HOOK = ROOT / "docs" / "hooks" / "bench_figures.py"
FLEET_START_S = 600
"""How long a fleet of servers a tool starts (gateway_bench, pd_bench) may take to come
up: a bound on a hang, not on speed (they load at once on the CI's two cores, beside
other tests' processes)."""


def load_module(path: Path, name: str) -> ModuleType:
    """``path`` imported as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
