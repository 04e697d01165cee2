"""Repository-wide pytest setup, shared by every package's tests.

* Debug invariants are on in every test run: ``TANDEM_DEBUG_FUTURES=1`` unless the
  caller already chose (the nox sessions set it explicitly too).
* Tests marked ``cuda``, ``rocm`` or ``gpu`` are skipped when no such device exists;
  those are the only tests that may be skipped.
* Without a GPU, Triton kernels (the ``triton`` attention backend, the rotary kernel)
  run in Triton's interpreter. Triton chooses interpreter or compiler when a kernel is
  decorated, its own library's included, and transformers and torch.compile import
  Triton, so ``TRITON_INTERPRET`` is set here, before any test module is imported.
"""

from __future__ import annotations

import os

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, available in _AVAILABLE.items():
            if item.get_closest_marker(marker) is not None and not available():
                item.add_marker(pytest.mark.skip(reason=f"needs a {marker} device"))
