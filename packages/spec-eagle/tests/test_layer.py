"""The spec-eagle layer installs in the shared namespace and never pulls in the server."""

from __future__ import annotations

import subprocess
import sys


def test_imports_in_the_shared_namespace() -> None:
    import tandem.spec_eagle

    assert tandem.spec_eagle.__doc__
    assert tandem.spec_eagle.LAYER == "spec_eagle"


def test_importing_spec_eagle_pulls_no_server() -> None:
    code = "import sys, tandem.spec_eagle\nsys.exit(1 if 'tandem.server' in sys.modules else 0)\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_scheduler_never_imports_spec_eagle() -> None:
    code = (
        "import sys, tandem.scheduler, tandem.scheduler.speculative.interface\n"
        "from tandem.scheduler.speculative.interface import speculative_algorithms\n"
        "assert {'EAGLE', 'EAGLE3'} <= set(speculative_algorithms())\n"
        "sys.exit(1 if 'tandem.spec_eagle' in sys.modules else 0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
