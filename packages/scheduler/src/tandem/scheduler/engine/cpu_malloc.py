"""The CPU engine's allocator setting: glibc keeps the memory a forward frees.

A CPU forward allocates and frees the same large activations (a prefill chunk's products,
the decode stage) at every layer and step. Under glibc's defaults the largest blocks go back
to the kernel when freed and the heap's free top is trimmed, so the next step faults their
pages in again, zeroed by the kernel on the forward's critical path. ``keep_freed_memory``
raises glibc's mmap and trim thresholds (``mallopt``) so that freed blocks stay and are
reused; the cost is resident memory, up to ``TRIM_THRESHOLD`` beyond the heap's use.
(measurements: docs/benchmarks.md, Measurements behind the code)
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (malloc.h)."""

MMAP_THRESHOLD = 1 << 30
"""Blocks below 1 GiB come from the heap, not from their own ``mmap``."""
TRIM_THRESHOLD = 1 << 30
"""The heap's free top goes back to the system only beyond 1 GiB."""
TOP_PAD = 256 << 20
"""Each growth of the heap asks the kernel for 256 MiB more than it needs (address
space: pages are backed when first written)."""


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process (see the module's docstring). Returns
    whether they were taken: False where the C library is not glibc (musl, macOS), whose
    allocators have no such thresholds. With another allocator preloaded (jemalloc,
    tcmalloc), ``mallopt`` is that allocator's, which ignores these settings."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # What an earlier engine of this process freed and the raised thresholds kept goes
    # back to the system first: each engine's forward thread allocates in its own arena,
    # so without this every engine created in one process (tests, notebooks) would add
    # its whole working set to the process's resident memory.
    _trim(libc)
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    taken = [bool(mallopt(param, value)) for param, value in settings]
    mallopt(M_TOP_PAD, TOP_PAD)
    return all(taken)


def release_freed_memory() -> None:
    """Give the system back what the allocator keeps of freed memory, once: after the
    weights are loaded, whose temporary buffers (a chunk's dequantized rows, the float
    weights int8 is made from, the row form the panels are made from) the raised
    thresholds would otherwise keep resident for the process's life. A no-op where the
    C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        _trim(libc)


def _glibc() -> ctypes.CDLL | None:
    """This process's C library, if it is glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return None
    return libc


def _trim(libc: ctypes.CDLL) -> None:
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim(0)
