"""The consume-once debug checks, each one fused function.

In debug mode every gather from the FutureMap asserts that what it reads was written
since the last read, then marks it read, in one function on the forward stream
(``CheckKernels``: ``torch.compile``'d on accelerators where that works, eager on the
CPU, where the compiled checks measured slower). Assertions use
``torch._assert_async``, so a check never makes the host wait for the device. Row 0,
the padding row, is exempt from every check. See docs/concepts/futuremap.md, "The
consume-once invariant".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tandem.futuremap.env import CompileChecks

log = logging.getLogger(__name__)

READ_UNWRITTEN = (
    "FutureMap consume-once violated: a row was resolved without a stash since its last "
    "resolve (or before its first stash); the forward would have read a stale value"
)
ROW_TWICE = "FutureMap consume-once violated: a row appears twice in one resolve"
NOT_POSITIVE = "FutureMap: a resolved sequence length is not positive (read before publish?)"


def _no_row_twice(size: int, rows: torch.Tensor) -> torch.Tensor:
    hits = torch.zeros(size, dtype=torch.int64, device=rows.device)
    hits.index_add_(0, rows, torch.ones_like(rows))
    return (hits[1:] <= 1).all()


def consume_tokens(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Gather ``buf[rows]`` (int64, unread values are >= 0), assert, write -1 back."""
    values = buf.index_select(0, rows)
    torch._assert_async(((values >= 0) | (rows == 0)).all(), READ_UNWRITTEN)
    torch._assert_async(_no_row_twice(buf.shape[0], rows), ROW_TWICE)
    buf.index_fill_(0, rows, -1)
    buf[0] = 0
    return values


def consume_flags(flags: torch.Tensor, rows: torch.Tensor) -> None:
    """The same check for a relay field whose values can be anything: ``flags[row]`` is
    1 while the row holds an unread value."""
    seen = flags.index_select(0, rows)
    torch._assert_async(((seen == 1) | (rows == 0)).all(), READ_UNWRITTEN)
    torch._assert_async(_no_row_twice(flags.shape[0], rows), ROW_TWICE)
    flags.index_fill_(0, rows, 0)
    flags[0] = 1


def guard_positive(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Gather sequence lengths and assert they are positive (padding row exempt)."""
    values = buf.index_select(0, rows)
    torch._assert_async(((values > 0) | (rows == 0)).all(), NOT_POSITIVE)
    return values


Kernel = Callable[..., torch.Tensor | None]


class CheckKernels:
    """The three checks for one device, compiled or eager.

    ``mode="auto"`` compiles on accelerators, not on the CPU, where the eager ops
    already run back to back on the host stream's worker and compiling measured slower
    (docs/concepts/futuremap.md, "The consume-once invariant"): each check is compiled
    on first use and probed on scratch data; if compilation fails on this device the
    eager function is used from then on (a check that *fires* is never mistaken for a
    failed compilation, because the probe runs on data that passes). ``"on"`` always
    compiles, ``"off"`` never does.
    """

    # Device types where ``auto`` means eager (see the class docstring).
    eager_by_default = frozenset({"cpu"})

    def __init__(self, device: torch.device, mode: CompileChecks) -> None:
        self.device = device
        self.mode = mode
        self.consume_tokens: Kernel = self._pick(consume_tokens, self._probe_tokens)
        self.consume_flags: Kernel = self._pick(consume_flags, self._probe_flags)
        self.guard_positive: Kernel = self._pick(guard_positive, self._probe_positive)

    def _pick(self, fn: Kernel, probe: Callable[[Kernel], None]) -> Kernel:
        if self.mode == "off" or (
            self.mode == "auto" and self.device.type in self.eager_by_default
        ):
            return fn
        key = (fn.__name__, self.device.type)
        cached = _COMPILED.get(key)
        if cached is not None:
            return cached
        compiled: Kernel = torch.compile(fn, dynamic=True, fullgraph=True)
        if self.mode == "on":
            _COMPILED[key] = compiled
            return compiled
        try:
            probe(compiled)
        except Exception as exc:  # noqa: BLE001 - any compile failure means: use eager
            log.warning("torch.compile of %s failed on %s; using eager: %r", key[0], key[1], exc)
            _COMPILED[key] = fn
            return fn
        _COMPILED[key] = compiled
        return compiled

    def _rows(self) -> torch.Tensor:
        return torch.tensor([1, 2], dtype=torch.int64, device=self.device)

    def _probe_tokens(self, kernel: Kernel) -> None:
        kernel(torch.zeros(4, dtype=torch.int64, device=self.device), self._rows())

    def _probe_flags(self, kernel: Kernel) -> None:
        kernel(torch.ones(4, dtype=torch.int8, device=self.device), self._rows())

    def _probe_positive(self, kernel: Kernel) -> None:
        kernel(torch.ones(4, dtype=torch.int64, device=self.device), self._rows())


# Process-wide cache of compiled checks, keyed by (check, device type): compilation is
# the expensive part and its result does not depend on any FutureMap's state.
_COMPILED: dict[tuple[str, str], Kernel] = {}
