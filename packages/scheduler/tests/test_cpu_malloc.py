"""The CPU engine's allocator setting (``cpu_malloc``): with it, a large block a step
frees stays in the process for the next one; without it glibc hands it back to the
kernel, and the next step faults its pages in again. Also: the engine sets it on the
CPU unless ``disable_cpu_malloc_tuning``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.scheduler import Engine, wiring

# Resident bytes kept after a 64 MiB tensor is written and freed, in a fresh process.
_RETAINED = """
import os, sys
import torch
from tandem.scheduler.cpu_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
before = resident()
block = torch.ones(64 << 20, dtype=torch.uint8)
del block
print(resident() - before)
"""


def _retained(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


def test_freed_blocks_stay_in_the_process_only_with_the_setting() -> None:
    mib = 1 << 20
    assert _retained("keep") > 48 * mib
    assert _retained("default") < 16 * mib


@pytest.mark.parametrize("disabled", [False, True])
def test_the_cpu_engine_sets_it_unless_disabled(
    disabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(wiring, "keep_freed_memory", lambda: calls.append(True) or True)
    with Engine(
        model_path="tandem-tiny",
        device="cpu",
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        disable_cpu_malloc_tuning=disabled,
    ) as engine:
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
    assert calls == ([] if disabled else [True])
