"""End-to-end engine benchmarks (asv): the figures the overlap schedule is about.

Every benchmark builds one warm :class:`tandem.scheduler.Engine` on the tiny test
model (``tandem-tiny``) and runs a fixed, seeded batch workload (16 requests, prompt lengths
drawn up to 64 tokens, 32 greedy new tokens each, EOS ignored, radix cache off so
every pass prefills the same tokens), three passes per sample to damp the noise of
a sub-second run. The figures come from the engine's own cumulative counters
(``get_server_info``), differenced around the passes.

Why each figure matters:

``track_ms_per_output_token``
    Wall time per generated token: what a user of the engine pays. The overlap
    loop (launch step N+1, then process step N on the host) hides host work behind
    the forward pass, so it should be lower with ``overlap=True``.
``track_device_idle_fraction``
    Share of the forward stream's time spent waiting for the host,
    ``idle / (busy + idle)``. This is the direct evidence of the overlap: without it
    the device waits for every schedule/process step; with it, the idle share
    should fall close to zero. A rise means host work leaked back onto the
    critical path.
``track_scheduler_us_per_step``
    Host time spent scheduling per forward step (µs). The overlap can hide it only
    while it stays below the forward time, so it is tracked on its own.

All three are "lower is better". That is asv's only convention: its regression
detection (``asv publish`` and ``asv compare``) reports an increase of any
benchmark, ``track_`` included, as a regression, and has no per-benchmark switch
to invert it. Figures that grow when things improve (tokens/s) are therefore not
tracked here; their inverses are.

The ``device`` parameter covers ``cpu`` and ``cuda``; ``cuda`` is skipped (asv
records it as n/a) where ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from tandem.scheduler import Engine

NUM_REQUESTS = 16
MAX_PROMPT_LEN = 64
MAX_NEW_TOKENS = 32
SEED = 0
PASSES = 3  # passes of the workload per sample (one pass: ~0.2 s on a 2-core CPU)
COUNTERS = (
    "device_busy_s",
    "device_idle_s",
    "scheduler_s",
    "forward_steps",
    "generated_tokens",
)


def skip_unavailable(device: str) -> None:
    """asv skips a parameter combination whose ``setup`` raises NotImplementedError."""
    if device == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("no CUDA device")


class EngineOverlap:
    """One warm engine per (device, overlap); fresh passes of the workload per sample."""

    params = (["cpu", "cuda"], [False, True])
    param_names = ("device", "overlap")
    # The first construction in a fresh cache writes the tiny model; a run of
    # the workload (PASSES passes) takes about half a second on a 2-core CPU.
    timeout = 180.0

    def setup(self, device: str, overlap: bool) -> None:
        skip_unavailable(device)
        self.engine = Engine(
            model_path="tandem-tiny",
            device=device,
            disable_overlap_schedule=not overlap,
            disable_radix_cache=True,
            disable_progress_bar=True,
        )
        vocab = self.engine.model_config.vocab_size
        rng = random.Random(SEED)
        self.prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, MAX_PROMPT_LEN))]
            for _ in range(NUM_REQUESTS)
        ]
        self.sampling = [
            {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            for _ in range(NUM_REQUESTS)
        ]
        # Warm-up: first forwards, allocator and kernel caches.
        self.engine.generate(input_ids=self.prompts[:4], sampling_params=self.sampling[:4])

    def teardown(self, device: str, overlap: bool) -> None:
        # asv runs teardown after a skipped setup too: there may be no engine.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def _run(self) -> dict[str, Any]:
        """Run the workload PASSES times; the counter deltas plus the wall time."""
        before = self.engine.get_server_info()
        start = time.perf_counter()
        for _ in range(PASSES):
            self.engine.generate(input_ids=self.prompts, sampling_params=self.sampling)
        wall_s = time.perf_counter() - start
        after = self.engine.get_server_info()
        delta: dict[str, Any] = {key: after[key] - before[key] for key in COUNTERS}
        delta["wall_s"] = wall_s
        return delta

    def track_ms_per_output_token(self, device: str, overlap: bool) -> float:
        """Wall milliseconds per generated token over the workload (lower is better)."""
        run = self._run()
        return run["wall_s"] * 1e3 / run["generated_tokens"]

    track_ms_per_output_token.unit = "ms"  # type: ignore[attr-defined]

    def track_device_idle_fraction(self, device: str, overlap: bool) -> float:
        """Forward-stream idle time / (busy + idle) over the workload (lower is better)."""
        run = self._run()
        return run["device_idle_s"] / (run["device_busy_s"] + run["device_idle_s"])

    track_device_idle_fraction.unit = "fraction"  # type: ignore[attr-defined]

    def track_scheduler_us_per_step(self, device: str, overlap: bool) -> float:
        """Host scheduling microseconds per forward step (lower is better)."""
        run = self._run()
        return run["scheduler_s"] * 1e6 / run["forward_steps"]

    track_scheduler_us_per_step.unit = "us"  # type: ignore[attr-defined]
