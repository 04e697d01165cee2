"""FutureMap and host-stream micro-benchmarks (asv).

The cost of one decode step's FutureMap traffic (stash a batch's sampled tokens at
their rows, resolve them as the next step's input ids), with and without the
consume-once debug checks, per device; and the latency of one host-stream round
trip (submit, run on the worker, result back on the host). Both sit on the host's
critical path of every step, so they bound how much the overlap loop can hide.

Lower is better for every figure (asv's convention for all benchmark types). The
``cuda`` parameter is skipped where ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import time

import torch

from tandem.futuremap import FutureMap, HostStream

NUM_ROWS = 1024
ROUNDS = 200


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class FutureMapStashResolve:
    """One decode step's FutureMap traffic: stash a batch's tokens, resolve them."""

    params = (["cpu", "cuda"], [1, 64, 512], [False, True])
    param_names = ("device", "batch", "debug")
    timeout = 300.0  # the debug checks compile on first use

    def setup(self, device: str, batch: int, debug: bool) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise NotImplementedError("no CUDA device")  # asv: skip this combination
        gen = torch.Generator().manual_seed(batch)
        self.fmap = FutureMap(num_rows=NUM_ROWS, device=device, debug=debug)
        # Rows and tokens live where the engine has them: on the forward device.
        self.rows = (torch.randperm(NUM_ROWS, generator=gen)[:batch] + 1).to(device)
        self.tokens = torch.randint(0, 32_000, (batch,), generator=gen).to(device)
        self.time_stash_resolve(device, batch, debug)  # warm-up (compiles the checks in debug)

    def time_stash_resolve(self, device: str, batch: int, debug: bool) -> None:
        self.fmap.stash(self.rows, self.tokens)
        self.fmap.resolve_tokens(self.rows)
        _synchronize(device)

    def track_stash_resolve_us(self, device: str, batch: int, debug: bool) -> float:
        """Microseconds per stash + resolve, averaged over 200 rounds (lower is better)."""
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(ROUNDS):
            self.fmap.stash(self.rows, self.tokens)
            self.fmap.resolve_tokens(self.rows)
        _synchronize(device)
        return (time.perf_counter() - start) / ROUNDS * 1e6

    track_stash_resolve_us.unit = "us"  # type: ignore[attr-defined]


class HostStreamRoundTrip:
    """Submit an empty callable to the host stream and wait for its result."""

    def setup(self) -> None:
        self.stream = HostStream("asv-host-stream")

    def teardown(self) -> None:
        self.stream.close()

    def time_round_trip(self) -> None:
        self.stream.submit(int).result()
