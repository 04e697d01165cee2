"""The scheduler's host cost per decode step (asv), at batch 1, 64 and 256.

The overlap loop hides the host's work (processing step N, scheduling and launching
step N + 1) behind the forward of step N only while that work is shorter than the
forward, and the work grows with the batch. This suite tracks it on its own, per
decode step, so that a rise shows at the commit that caused it.

Every sample runs ``batch`` requests of 8 prompt tokens with 64 greedy new tokens each
(EOS ignored, radix cache off) through one warm engine on the tiny test model,
``max_running_requests`` raised to 256 so that the whole batch decodes together. The
figure is the difference of the engine counters ``decode_scheduler_s`` and
``decode_steps`` (``get_server_info``) over the sample: host microseconds of the
scheduler thread per iteration that launched a decode batch, the waits for copy-done
left out. Prefill iterations are not counted. Smaller batches run more passes of the
workload (up to 8), so that no sample is too short to time: each takes half a second
or less on a 2-core CPU.

Lower is better (asv's only convention). The ``device`` parameter covers ``cpu`` and
``cuda``; ``cuda`` is skipped (asv records it as n/a) where ``torch.cuda.is_available()``
is false.
"""

from __future__ import annotations

import random

import torch

from tandem.scheduler import Engine

BATCHES = (1, 64, 256)
PROMPT_LEN = 8
MAX_NEW_TOKENS = 64
SEED = 0


def passes(batch: int) -> int:
    """Passes of the workload per sample: up to 8 for small batches, 1 at 256 rows."""
    return min(8, max(1, max(BATCHES) // batch))


class HostCost:
    """One warm engine per (device, batch, overlap); fresh passes of the workload per sample."""

    params = (["cpu", "cuda"], list(BATCHES), [False, True])
    param_names = ("device", "batch", "overlap")
    # The first construction in a fresh cache writes the tiny model.
    timeout = 180.0

    def setup(self, device: str, batch: int, overlap: bool) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise NotImplementedError("no CUDA device")  # asv: skip this combination
        self.engine = Engine(
            model_path="tandem-tiny",
            device=device,
            disable_overlap_schedule=not overlap,
            disable_radix_cache=True,
            disable_progress_bar=True,
            max_running_requests=max(BATCHES),
        )
        vocab = self.engine.model_config.vocab_size
        rng = random.Random(SEED)
        self.prompts = [[rng.randrange(vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        self.sampling = [
            {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        ] * batch
        # Warm-up at this batch size: first forwards, the decode trace, allocator caches.
        self.engine.generate(input_ids=self.prompts, sampling_params=self.sampling)

    def teardown(self, device: str, batch: int, overlap: bool) -> None:
        # asv runs teardown after a skipped setup too: there may be no engine.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def track_host_us_per_decode_step(self, device: str, batch: int, overlap: bool) -> float:
        """Scheduler-thread host microseconds per decode step (lower is better)."""
        before = self.engine.get_server_info()
        for _ in range(passes(batch)):
            self.engine.generate(input_ids=self.prompts, sampling_params=self.sampling)
        after = self.engine.get_server_info()
        seconds: float = after["decode_scheduler_s"] - before["decode_scheduler_s"]
        steps: int = after["decode_steps"] - before["decode_steps"]
        return seconds * 1e6 / steps

    track_host_us_per_decode_step.unit = "us"  # type: ignore[attr-defined]
