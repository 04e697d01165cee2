"""The GPU path against references: bf16 parity with transformers on the GPU, overlap
loop = normal loop, CUDA graph = eager, Triton = torch backend, and a profiled overlap
step with no synchronisation besides the copy-done wait.

Every test here is ``cuda``-marked: skipped on machines without a CUDA GPU, run by
``nox -s tests-cuda``. Exactness tests run in float32 (no TF32: torch's default matmul
precision), so that any difference is a bug rather than rounding; the bf16 tests
compare against transformers with tolerances scaled by bf16's own error.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_models import FAMILIES, VOCAB, DenseCausalAttention, load_reference
from test_engine import _teacher_forced_logits
from test_models import _prompts

from tandem.scheduler import Engine
from tandem.scheduler.models import ModelConfig, load_model

pytestmark = pytest.mark.cuda

GREEDY = {"temperature": 0, "ignore_eos": True}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _engine(path: Path, **options: Any) -> Engine:
    opts: dict[str, Any] = {"dtype": "float32", "device": "cuda", "max_total_tokens": 4096}
    opts.update(options)
    return Engine(model_path=str(path), **opts)


def _workload(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    return [
        (shared[: rng.randint(0, 20)] if i % 2 else [])
        + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))]
        for i in range(count)
    ]


def _generate(path: Path, prompts: list[list[int]], new_tokens: int, **options: Any) -> list:
    with _engine(path, **options) as engine:
        out = engine.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new_tokens}
        )
    return [r["output_ids"] for r in out]


# -- bf16 parity with transformers -----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_match_transformers_on_the_gpu(
    checkpoints: dict[str, Path], family: str
) -> None:
    """tandem's bf16 forward is as close to transformers' float32 logits as
    transformers' own bf16 forward is (both on the GPU)."""
    path = checkpoints[family]
    prompts = [p.cuda() for p in _prompts(VOCAB, seed=7)]
    model = load_model(path, ModelConfig.from_pretrained(path), dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ids = torch.cat(prompts)
        positions = torch.cat([torch.arange(len(p), device="cuda") for p in prompts])
        attn = DenseCausalAttention([len(p) for p in prompts])
        ours = model.compute_logits(model(ids, positions, attn))
        hf32 = load_reference(path).cuda()
        ref = torch.cat([hf32(input_ids=p[None]).logits[0].float() for p in prompts])
        hf16 = hf32.to(torch.bfloat16)
        theirs = torch.cat([hf16(input_ids=p[None]).logits[0].float() for p in prompts])
    bound = max(2.0 * _rel(theirs, ref), 1e-2)
    assert _rel(ours, ref) <= bound, (_rel(ours, ref), _rel(theirs, ref))
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_bf16_engine_greedy_tokens_follow_transformers(checkpoints: dict[str, Path]) -> None:
    """The bf16 engine on the GPU (Triton attention, CUDA graphs, overlap loop) makes
    transformers' greedy tokens; a divergence is allowed only at a bf16-sized near-tie
    of the float32 reference, and is then not followed further."""
    path = checkpoints["llama3"]
    prompts = _workload(seed=3, count=6)
    outs = _generate(path, prompts, 16, dtype="bfloat16")
    cpu_reference = load_reference(path)  # float32, for teacher-forced margins
    hf = load_reference(path).cuda()
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out) == 16
        ids = torch.tensor([prompt], device="cuda")
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
            min_new_tokens=16, pad_token_id=0, eos_token_id=None,
        )[0, len(prompt) :].tolist()  # fmt: skip
        if out == expected:
            continue
        logits = _teacher_forced_logits(cpu_reference, prompt, out)
        j = next(i for i, (a, b) in enumerate(zip(out, expected, strict=True)) if a != b)
        margin = (logits[j].max() - logits[j, out[j]]).item()
        assert margin <= 0.05 * logits[j].std().item(), f"step {j}: margin {margin}"


# -- exactness between GPU paths (float32) ---------------------------------------------------


def test_overlap_equals_normal_on_the_gpu(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen3"]
    prompts = _workload(seed=11, count=24)
    overlap = _generate(path, prompts, 20, max_running_requests=8, chunked_prefill_size=64)
    normal = _generate(
        path, prompts, 20, max_running_requests=8, chunked_prefill_size=64,
        disable_overlap_schedule=True,
    )  # fmt: skip
    assert overlap == normal


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_equals_eager_and_backends_agree(
    checkpoints: dict[str, Path], backend: str
) -> None:
    """Triton with CUDA graphs, Triton eager and the torch backend make the same
    float32 greedy tokens, with batch sizes that are and are not captured exactly."""
    path = checkpoints["llama"]
    prompts = _workload(seed=5, count=13)
    reference = _generate(path, prompts, 12, attention_backend="torch")
    with _engine(path, attention_backend=backend, cuda_graph_max_bs=8) as engine:
        sizes = engine.cuda_graph_batch_sizes
        got = [
            r["output_ids"]
            for r in engine.generate(
                input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12}
            )
        ]
    assert sizes == ([1, 2, 4, 8] if backend == "triton" else [])
    assert got == reference
    eager = _generate(path, prompts, 12, attention_backend=backend, disable_cuda_graph=True)
    assert eager == reference


# -- no hidden synchronisation -----------------------------------------------------------------

# Runtime calls that block the host on the device. cudaEventSynchronize is the one
# allowed: it is the copy-done wait.
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def test_overlap_decode_steps_never_synchronise(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steady stretch of the overlap loop makes no synchronising call besides the
    copy-done waits: torch's sync debug mode turns any (``.item()``, ``.tolist()`` of
    device data, a stream or device synchronize, a blocking copy) into an error that
    fails the run, and the profile shows no blocking runtime call between the first
    and the last copy-done wait. (The debug checks read the device, so they are off.)"""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("TANDEM_DEBUG_FUTURES", "0")
    path = checkpoints["llama"]
    prompts = _workload(seed=9, count=8)
    params = {**GREEDY, "max_new_tokens": 24}
    with _engine(path) as engine:
        engine.generate(input_ids=prompts, sampling_params=params)  # warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = engine.generate(input_ids=prompts, sampling_params=params)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert [len(r["output_ids"]) for r in got] == [24] * len(prompts)
    events = prof.events()
    waits = [e for e in events if e.name == "cudaEventSynchronize"]
    assert waits, "the profile holds no copy-done wait of the scheduler thread"
    first = min(e.time_range.start for e in waits)
    last = max(e.time_range.end for e in waits)
    blocking = sorted(
        {e.name for e in events if e.name in _SYNCS and first <= e.time_range.start <= last}
    )
    assert not blocking, f"hidden synchronisation in the loop: {blocking}"
