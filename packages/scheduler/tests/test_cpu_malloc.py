"""The CPU engine's allocator setting (``cpu_malloc``): with it, a large block a step
frees stays in the process for the next one; without it glibc hands it back to the
kernel, and the next step faults its pages in again. Also: the engine sets it on the
CPU unless ``disable_cpu_malloc_tuning``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.scheduler import Engine
from tandem.scheduler.engine import wiring

# What both scripts below start with: the setting's function and a resident-bytes probe.
_PRELUDE = """
import os, sys, threading
import torch
from tandem.scheduler.engine.cpu_malloc import keep_freed_memory
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
"""
# Resident bytes kept after a 64 MiB tensor is written and freed, in a fresh process.
_RETAINED = (
    _PRELUDE
    + """
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = resident()
block = torch.ones(64 << 20, dtype=torch.uint8)
del block
print(resident() - before)
"""
)


# Resident bytes a block written and freed on another thread (its own arena, as an
# engine's forward thread has) leaves behind, before and after the setting is taken
# again, as the next engine of the process takes it.
_NEXT_ENGINE = (
    _PRELUDE
    + """
assert keep_freed_memory()
before = resident()
def step():  # a step's activations: many blocks of a few MiB
    blocks = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(16)]
    del blocks
thread = threading.Thread(target=step)
thread.start()
thread.join()
kept = resident() - before
keep_freed_memory()
print(kept, resident() - before)
"""
)


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


def test_the_next_engine_gives_back_what_an_earlier_one_kept() -> None:
    """Each engine's forward thread allocates in an arena of its own: without a trim
    when the next engine starts, every engine made in one process (a test session, a
    notebook) would add its whole working set to the resident memory for good."""
    _assert_kept_then_given_back(_NEXT_ENGINE)


# Resident bytes a load's temporary buffers leave behind under the setting, before and
# after ``release_freed_memory``, as the engine calls it once the weights are loaded.
_AFTER_LOAD = (
    _PRELUDE
    + """
from tandem.scheduler.engine.cpu_malloc import release_freed_memory
assert keep_freed_memory()
before = resident()
buffers = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(16)]  # a load's
del buffers
kept = resident() - before
release_freed_memory()
print(kept, resident() - before)
"""
)


def test_what_loading_the_weights_freed_goes_back_to_the_system() -> None:
    _assert_kept_then_given_back(_AFTER_LOAD)


def _assert_kept_then_given_back(script: str) -> None:
    """``script`` prints the resident bytes its freed blocks left, then what was left
    after they were given back: over 192 MiB kept (the setting), under 32 MiB after."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kept, after = map(int, done.stdout.split())
    mib = 1 << 20
    assert kept > 192 * mib
    assert after < 32 * mib
