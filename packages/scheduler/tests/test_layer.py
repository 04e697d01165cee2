"""The scheduler layer installs on top of core-futuremap in the shared namespace and
never pulls in the layers above it (docs/index.md, "The four layers") or GPU-only libraries."""

from __future__ import annotations

import subprocess
import sys


def test_imports_in_the_shared_namespace() -> None:
    import tandem.futuremap
    import tandem.scheduler

    assert tandem.scheduler.__doc__
    assert tandem.scheduler.Engine is not None
    assert tandem.futuremap.FutureMap is not None


def test_importing_the_scheduler_pulls_no_upper_layer_and_no_gpu_library() -> None:
    code = (
        "import sys, tandem.scheduler\n"
        "upper = ('tandem.spec_eagle', 'tandem.server', 'flashinfer')\n"
        "bad = [m for m in upper if m in sys.modules]\n"
        "sys.exit(f'imported {bad}' if bad else 0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
