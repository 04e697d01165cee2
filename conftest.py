"""Repository-wide pytest setup, shared by every package's tests.

* Debug invariants are on in every test run: ``TANDEM_DEBUG_FUTURES=1`` unless the
  caller already chose (the nox sessions set it explicitly too).
* Tests marked ``cuda``, ``rocm`` or ``gpu`` are skipped when no such device exists;
  those are the only tests that may be skipped.
* Without a GPU, Triton kernels (the ``triton`` attention backend, the rotary kernel)
  run in Triton's interpreter. Triton chooses interpreter or compiler when a kernel is
  decorated, its own library's included, and transformers and torch.compile import
  Triton, so ``TRITON_INTERPRET`` is set here, before any test module is imported.
* ``TANDEM_TEST_ATTENTION_BACKEND`` (set by the GPU sessions' matrix, e.g.
  ``nox -s "tests-cuda(backend='flashinfer')"``) is the attention backend of every GPU
  engine a test builds in this process without naming one; unset, the engine's own
  default (``triton``). Tests that name a backend keep theirs, and CPU engines keep
  ``torch``. Only this file reads the variable: the packages never do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("TANDEM_DEBUG_FUTURES", "1")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None


def _has_rocm() -> bool:
    return torch.cuda.is_available() and torch.version.hip is not None


def _has_gpu() -> bool:
    return torch.cuda.is_available()


_AVAILABLE = {"cuda": _has_cuda, "rocm": _has_rocm, "gpu": _has_gpu}

_BACKEND_ENV = "TANDEM_TEST_ATTENTION_BACKEND"
_BACKENDS = ("torch", "triton", "flashinfer")


def _test_backend() -> str | None:
    value = os.environ.get(_BACKEND_ENV) or None
    if value is not None and value not in _BACKENDS:
        raise pytest.UsageError(f"{_BACKEND_ENV}={value!r}: choose one of {', '.join(_BACKENDS)}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    _test_backend()  # a wrong value stops the run here, in one line


def pytest_report_header(config: pytest.Config) -> str | None:
    backend = _test_backend()
    return (
        None if backend is None else f"GPU engines' attention backend: {backend} ({_BACKEND_ENV})"
    )


@pytest.fixture(autouse=True, scope="session")
def _gpu_engines_attention_backend() -> Iterator[None]:
    """Make ``TANDEM_TEST_ATTENTION_BACKEND`` the default backend of GPU engines."""
    backend = _test_backend()
    if backend is None:
        yield
        return
    from tandem.scheduler.engine import wiring

    default = wiring.default_backend

    def chosen(device: torch.device) -> str:
        return backend if device.type == "cuda" else default(device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wiring, "default_backend", chosen)
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, available in _AVAILABLE.items():
            if item.get_closest_marker(marker) is not None and not available():
                item.add_marker(pytest.mark.skip(reason=f"needs a {marker} device"))
