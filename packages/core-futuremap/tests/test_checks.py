"""How the debug checks are run: compiled, eager, and the fallback when compiling fails."""

from __future__ import annotations

import pytest
import torch

from tandem.futuremap import checks
from tandem.futuremap.checks import CheckKernels

CPU = torch.device("cpu")


def test_off_and_cpu_auto_are_the_eager_functions() -> None:
    for mode in ("off", "auto"):
        kernels = CheckKernels(CPU, mode)  # type: ignore[arg-type]
        assert kernels.consume_tokens is checks.consume_tokens
        assert kernels.consume_flags is checks.consume_flags
        assert kernels.guard_positive is checks.guard_positive


def test_on_compiles_even_on_the_cpu() -> None:
    kernels = CheckKernels(CPU, "on")
    assert kernels.consume_tokens is not checks.consume_tokens
    buf = torch.tensor([0, 5, 6, -1])
    assert kernels.consume_tokens(buf, torch.tensor([2, 1])).tolist() == [6, 5]
    assert buf.tolist() == [0, -1, -1, -1]


def test_auto_falls_back_to_eager_when_compiling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_compile(fn: object, **_: object) -> object:
        def run(*args: object) -> None:
            raise RuntimeError("no compiler for this device")

        return run

    monkeypatch.setattr(checks, "_COMPILED", {})
    monkeypatch.setattr(CheckKernels, "eager_by_default", frozenset())
    monkeypatch.setattr(torch, "compile", broken_compile)
    kernels = CheckKernels(CPU, "auto")
    assert kernels.consume_tokens is checks.consume_tokens
    assert kernels.guard_positive is checks.guard_positive
    # the checks still fire in eager mode
    with pytest.raises(RuntimeError, match="consume-once"):
        kernels.consume_tokens(torch.tensor([0, -1]), torch.tensor([1]))


def test_auto_keeps_a_working_compiled_check(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_compile(fn: checks.Kernel, **_: object) -> checks.Kernel:
        def run(*args: torch.Tensor) -> torch.Tensor | None:
            calls.append(fn.__name__)
            return fn(*args)

        return run

    monkeypatch.setattr(checks, "_COMPILED", {})
    monkeypatch.setattr(CheckKernels, "eager_by_default", frozenset())
    monkeypatch.setattr(torch, "compile", fake_compile)
    kernels = CheckKernels(CPU, "auto")
    assert kernels.consume_tokens is not checks.consume_tokens
    assert sorted(calls) == ["consume_flags", "consume_tokens", "guard_positive"]  # probes
