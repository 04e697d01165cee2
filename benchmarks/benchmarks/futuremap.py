"""FutureMap and host-stream micro-benchmarks (asv).

Placeholders until the engine benchmarks land: the cost of one stash + resolve round
for a decode batch, with and without the debug checks, and the latency of one
host-stream round trip (submit, run on the worker, result back on the host).
"""

from __future__ import annotations

import torch

from tandem.futuremap import FutureMap, HostStream

NUM_ROWS = 1024


class FutureMapStashResolve:
    """One decode step's FutureMap traffic: stash a batch's tokens, resolve them."""

    params = ([1, 64, 512], [False, True])
    param_names = ("batch", "debug")
    timeout = 300.0  # the debug checks compile on first use

    def setup(self, batch: int, debug: bool) -> None:
        gen = torch.Generator().manual_seed(batch)
        self.fmap = FutureMap(num_rows=NUM_ROWS, device="cpu", debug=debug)
        self.rows = torch.randperm(NUM_ROWS, generator=gen)[:batch] + 1
        self.tokens = torch.randint(0, 32_000, (batch,), generator=gen)
        self.time_stash_resolve(batch, debug)  # warm-up (compiles the checks in debug)

    def time_stash_resolve(self, batch: int, debug: bool) -> None:
        self.fmap.stash(self.rows, self.tokens)
        self.fmap.resolve_tokens(self.rows)

    def track_stash_resolve_us(self, batch: int, debug: bool) -> float:
        """Microseconds per stash + resolve, averaged over 200 rounds."""
        import time

        rounds = 200
        start = time.perf_counter()
        for _ in range(rounds):
            self.time_stash_resolve(batch, debug)
        return (time.perf_counter() - start) / rounds * 1e6

    track_stash_resolve_us.unit = "us"  # type: ignore[attr-defined]


class HostStreamRoundTrip:
    """Submit an empty callable to the host stream and wait for its result."""

    def setup(self) -> None:
        self.stream = HostStream("asv-host-stream")

    def teardown(self) -> None:
        self.stream.close()

    def time_round_trip(self) -> None:
        self.stream.submit(int).result()
