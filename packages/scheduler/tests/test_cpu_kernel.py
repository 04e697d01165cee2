"""The CPU decode kernel (``torch.ops.tandem.decode_attention``, built from
``kernels/cpu_decode.cpp``): its output against float64 SDPA at every head size it
specializes and ones it does not, on its AVX-512 path and its generic one (a head of
40 elements, 12 query heads per KV head), with masked keys, key counts that are not a
multiple of its sixteen- or four-key blocks and the gathered pages' strides; the bad
inputs it refuses; the build's cache and its fallback to SDPA; and an engine's tokens
with the kernel equal to its tokens with SDPA, in both loops, through the decode
trace."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.scheduler import Engine
from tandem.scheduler.attention import base as attention_base
from tandem.scheduler.attention import torch_backend
from tandem.scheduler.attention.cpu_decode import bf16_kernel_fits, grouped_decode, kernel_fits
from tandem.scheduler.attention.decode_stage import append_to_stage
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models.tiny import cache_root


@pytest.fixture(scope="module")
def kernel_dir() -> Path:
    """Where engines keep the kernel: one registration per process, so this module
    loads the build the engines (in this process or another) load."""
    path = cache_root() / "kernels"
    assert cpu_build.load_cpu_kernels(path)
    return path


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> Any:
    b, heads, dim = q.shape
    kv_heads = k.shape[1]
    queries = q.double().view(b, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        queries, k.double(), v.double(), attn_mask=bias.double(), scale=dim**-0.5
    )
    return out.reshape(b, heads * dim)


def _bias(lens: list[int], length: int) -> torch.Tensor:
    masked = torch.arange(length).view(1, -1) >= torch.tensor(lens).view(-1, 1)
    bias = torch.zeros(len(lens), length).masked_fill_(masked, float("-inf"))
    return bias.view(len(lens), 1, 1, length)


# 40: where the AVX-512 kernel cannot take it (not a multiple of 16), the AVX2 one;
# 20: neither, the generic kernel.
@pytest.mark.parametrize("dim", [16, 32, 64, 128, 48, 40, 20])
@pytest.mark.parametrize("group", [1, 3, 7, 12])
def test_kernel_equals_float64_attention(kernel_dir: Path, dim: int, group: int) -> None:
    gen = torch.Generator().manual_seed(dim * 10 + group)
    kv_heads, lens = 2, [1, 7, 33, 30, 4, 16, 17]
    length = max(lens)  # 33: one key past the last sixteen- (eight-, four-) key block
    b = len(lens)
    # A stage: capacity 64, cut to the longest request; its keys past each length hold
    # whatever the cache had (the mask hides them).
    k = torch.randn(b, kv_heads, 64, dim, generator=gen)[:, :, :length]
    v = torch.randn(b, kv_heads, 64, dim, generator=gen)[:, :, :length]
    q = torch.randn(b, kv_heads * group, dim, generator=gen)
    bias = _bias(lens, length)
    out = torch.ops.tandem.decode_attention(q, k, v, bias, dim**-0.5)
    assert out.shape == (b, kv_heads * group * dim)
    assert (out.double() - _reference(q, k, v, bias)).abs().max().item() < 2e-6


def test_a_request_with_every_key_masked_gets_zeros(kernel_dir: Path) -> None:
    k = torch.randn(2, 1, 5, 16)
    bias = _bias([3, 0], 5)
    out = torch.ops.tandem.decode_attention(torch.randn(2, 2, 16), k, k, bias, 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(2 * 16))


def test_kernel_reads_the_gathered_pages_strides(kernel_dir: Path) -> None:
    # The step that starts no stage attends its gathered pages, [B, L, Hkv, D] seen
    # as [B, Hkv, L, D]; and a query that is a view of a fused projection.
    gen = torch.Generator().manual_seed(3)
    gathered_k = torch.randn(3, 21, 4, 64, generator=gen)
    gathered_v = torch.randn(3, 21, 4, 64, generator=gen)
    k, v = gathered_k.transpose(1, 2), gathered_v.transpose(1, 2)
    q = torch.randn(3, 12 * 64 * 2, generator=gen)[:, : 12 * 64].view(3, 12, 64)
    assert not q.is_contiguous()
    bias = _bias([21, 5, 12], 21)
    out = grouped_decode(q, k, v, bias, 0.125, kernel=True)
    expected = grouped_decode(q, k, v, bias, 0.125, kernel=False)
    assert (out - expected).abs().max().item() < 2e-6


def test_kernel_refuses_what_it_cannot_attend(kernel_dir: Path) -> None:
    k = torch.randn(2, 2, 8, 16)
    q, bias = torch.randn(2, 4, 16), torch.zeros(2, 1, 1, 8)
    op = torch.ops.tandem.decode_attention
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q.half(), k.half(), k.half(), bias.half(), 0.25)
    with pytest.raises(RuntimeError, match="all of one dtype"):
        op(q, k.bfloat16(), k.bfloat16(), bias.bfloat16(), 0.25)
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.randn(2, 3, 16), k, k, bias, 0.25)  # 3 heads over 2 KV heads
    with pytest.raises(RuntimeError, match="same strides"):
        op(q, k, k.contiguous().transpose(2, 3).contiguous().transpose(2, 3), bias, 0.25)
    with pytest.raises(RuntimeError, match="bias"):
        op(q, k, k, torch.zeros(2, 1, 1, 7), 0.25)
    # bfloat16 heads of 16 elements: the bfloat16 path takes multiples of 32 only (or,
    # on a CPU without AVX512-BF16, no bfloat16 at all).
    needs = "a multiple of 32" if cpu_build.bf16_kernels() else "AVX512-BF16"
    with pytest.raises(RuntimeError, match=needs):
        op(q.bfloat16(), k.bfloat16(), k.bfloat16(), bias.bfloat16(), 0.25)


def test_which_steps_the_kernel_takes(kernel_dir: Path) -> None:
    k = torch.randn(1, 1, 8, 32)
    q = torch.randn(1, 3, 32)
    assert kernel_fits(q, k, k)
    assert kernel_fits(q.bfloat16(), k.bfloat16(), k.bfloat16())
    assert not kernel_fits(q, k, k.transpose(2, 3).contiguous().transpose(2, 3))
    assert not kernel_fits(q.half(), k.half(), k.half())
    narrow = k.bfloat16()[..., :16]
    assert not kernel_fits(q.bfloat16()[..., :16], narrow, narrow)  # D=16
    assert not kernel_fits(torch.randn(1, 9, 32).bfloat16(), k.bfloat16(), k.bfloat16())
    assert bf16_kernel_fits(32, 8, 128)
    assert not bf16_kernel_fits(14, 2, 48)
    assert not bf16_kernel_fits(16, 1, 64)  # 16 query heads to a KV head


def _bf16_case(group: int, dim: int, lens: list[int], seed: int) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    kv_heads, b = 2, len(lens)
    length = max(lens)
    k = torch.randn(b, kv_heads, length + 20, dim, generator=gen).bfloat16()[:, :, :length]
    v = torch.randn(b, kv_heads, length + 20, dim, generator=gen).bfloat16()[:, :, :length]
    q = torch.randn(b, kv_heads * group, dim, generator=gen).bfloat16()
    return q, k, v, _bias(lens, length).bfloat16()


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bfloat16_kernel_equals_float64_attention(kernel_dir: Path, dim: int, group: int) -> None:
    """Sixteen-key blocks and the keys after the last one (lengths 1, 15, 16, 17, 33,
    50), an odd last key for the pairs of values; within bfloat16's rounding of the
    weights and of the output, closer than the two matrix products."""
    lens = [1, 15, 16, 17, 33, 50]
    q, k, v, bias = _bf16_case(group, dim, lens, seed=dim + group)
    op = torch.ops.tandem.decode_attention
    if not cpu_build.bf16_kernels():  # a CPU without AVX512-BF16: a clear refusal
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            op(q, k, v, bias, dim**-0.5)
        return
    out = op(q, k, v, bias, dim**-0.5)
    assert out.dtype == torch.bfloat16
    assert out.shape == (len(lens), 2 * group * dim)
    want = _reference(q, k, v, bias)
    products = grouped_decode(q, k, v, bias, dim**-0.5, kernel=False)
    error = (out.double() - want).abs().max().item()
    assert error <= max((products.double() - want).abs().max().item(), 2e-3)
    assert error < 1e-2


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bfloat16_decode_with_the_kernel_on_equals_float64_attention(
    kernel_dir: Path, dim: int, group: int
) -> None:
    """A bfloat16 step with the kernel on (the engine turns it on for bfloat16 on every
    CPU): AVX512-BF16's kernel where the build has it and takes the heads (a multiple
    of 32 elements), else the float32 kernel over the operands widened, its output
    rounded once (exactly that, and the op in the profile). Either way within
    bfloat16's rounding of the float64 attention, and closer than the two matrix
    products."""
    lens = [1, 15, 16, 17, 33, 50]
    q, k, v, bias = _bf16_case(group, dim, lens, seed=7 * dim + group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = grouped_decode(q, k, v, bias, dim**-0.5, kernel=True)
    assert "tandem::decode_attention" in {event.key for event in prof.key_averages()}
    assert out.dtype == torch.bfloat16
    if not (cpu_build.bf16_kernels() and bf16_kernel_fits(2 * group, 2, dim)):
        wide = torch.ops.tandem.decode_attention(
            q.float(), k.float(), v.float(), bias.float(), dim**-0.5
        )
        assert out.equal(wide.bfloat16())
    want = _reference(q, k, v, bias)
    products = grouped_decode(q, k, v, bias, dim**-0.5, kernel=False)
    error = (out.double() - want).abs().max().item()
    assert error <= max((products.double() - want).abs().max().item(), 2e-3)
    assert error < 1e-2


def test_bfloat16_kernel_reads_the_gathered_pages_strides(kernel_dir: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    gathered = torch.randn(2, 2, 37, 4, 64, generator=gen).bfloat16()
    k, v = gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)  # [B, Hkv, L, D]
    q = torch.randn(2, 12, 64, generator=gen).bfloat16()
    bias = _bias([37, 20], 37).bfloat16()
    if not cpu_build.bf16_kernels():  # a CPU without AVX512-BF16: a clear refusal
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            torch.ops.tandem.decode_attention(q, k, v, bias, 0.125)
        return
    out = torch.ops.tandem.decode_attention(q, k, v, bias, 0.125)
    contiguous = torch.ops.tandem.decode_attention(q, k.contiguous(), v.contiguous(), bias, 0.125)
    assert torch.equal(out, contiguous)
    assert (out.double() - _reference(q, k, v, bias)).abs().max().item() < 1e-2


def test_a_build_is_kept_and_loaded_again(
    kernel_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = cpu_build._compiler()
    assert compiler is not None
    built = cpu_build.library_path(kernel_dir, compiler, cpu_build._flags())
    assert built.is_file()
    stamp = built.stat().st_mtime_ns
    os.utime(built, ns=(0, stamp))  # last loaded long ago
    monkeypatch.setattr(cpu_build, "loaded", lambda: False)  # as a new process would
    monkeypatch.setattr(cpu_build, "_build", lambda *args: pytest.fail("built again"))
    # Recorded, not loaded: this process may hold another file's registration of the
    # same ops (a test's build in a temporary folder), and a second one aborts it.
    loads: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    assert cpu_build.load_cpu_kernels(kernel_dir)
    assert loads == [str(built)]
    assert built.stat().st_mtime_ns == stamp
    assert built.stat().st_atime > time.time() - 60  # the load marked it used
    # Another source, torch, compiler or flag set is another file.
    assert cpu_build.library_path(kernel_dir, compiler, [*cpu_build._flags(), "-g"]) != built


def test_builds_no_process_loaded_for_30_days_are_removed(tmp_path: Path) -> None:
    now = time.time()
    long_ago = now - cpu_build.UNUSED_FOR_S - 60

    def build(name: str, used: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"")
        path.with_suffix(".lock").write_bytes(b"")
        os.utime(path, (used, used))
        return path

    keep = build("cpu_kernels-1111.so", long_ago)  # the one being loaded
    unused = build("cpu_kernels-2222.so", long_ago)
    renamed = build("decode_attention-3333.so", long_ago)  # the name before the rename
    recent = build("cpu_kernels-4444.so", now - 3600)
    foreign = build("libother.so", long_ago)
    busy = build("cpu_kernels-5555.so", long_ago)
    with open(busy.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building or loading it
        removed = cpu_build.remove_unused(tmp_path, keep=keep, now=now)
    assert removed == [unused, renamed]
    for gone in removed:
        assert not gone.exists()
        assert not gone.with_suffix(".lock").exists()
    for kept in (keep, recent, foreign, busy):
        assert kept.exists()
        assert kept.with_suffix(".lock").exists()


def test_without_a_compiler_or_with_a_failing_one_sdpa_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_build, "loaded", lambda: False)
    monkeypatch.setattr(cpu_build, "COMPILERS", ("tandem-no-such-compiler",))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_build.load_cpu_kernels(tmp_path)
    assert "no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_build, "COMPILERS", ("false",))  # exits 1, builds nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_build.load_cpu_kernels(tmp_path)
    assert "CPU kernels not built" in caplog.text
    assert not list(tmp_path.glob("*.so"))


def test_a_build_that_times_out_is_a_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The compilers, really started, outlive the bound (one second, the least the
    build waits): they are killed, nothing is linked, and the torch formulas stay."""
    monkeypatch.setattr(cpu_build, "loaded", lambda: False)
    monkeypatch.setattr(cpu_build, "BUILD_TIMEOUT_S", 0)
    linked: list[Any] = []
    monkeypatch.setattr(cpu_build.subprocess, "run", lambda *a, **k: linked.append(a))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_build.load_cpu_kernels(tmp_path)
    assert "CPU kernels not built" in caplog.text
    assert "timed out" in caplog.text
    assert not linked
    assert not list(tmp_path.glob("*.so"))


INPUTS = [[(13 * i + 7 * j) % 250 + 4 for j in range(5 + 11 * i)] for i in range(6)]
MAX_NEW = [3, 70, 21, 150, 9, 44]


def _tokens(kernel: bool, overlap: bool) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path="tandem-tiny",
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        disable_progress_bar=True,
        disable_cpu_decode_kernel=not kernel,
        disable_overlap_schedule=not overlap,
    )
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW]
    try:
        results = engine.generate(input_ids=INPUTS, sampling_params=params)
        return [r["output_ids"] for r in results], engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_engine_tokens_with_the_kernel_equal_tokens_with_sdpa(overlap: bool) -> None:
    with_kernel, engine = _tokens(kernel=True, overlap=overlap)
    with_sdpa, plain = _tokens(kernel=False, overlap=overlap)
    assert engine.scheduler.runner.attention.decode_kernel
    assert not plain.scheduler.runner.attention.decode_kernel
    trace = engine.scheduler.runner.decode_trace
    assert trace is not None
    assert trace.replays > 0  # the trace ran the kernel too
    assert with_kernel == with_sdpa
    assert [len(ids) for ids in with_kernel] == MAX_NEW


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_bfloat16_engine_with_the_kernel_replays_what_it_runs_eagerly(
    checkpoints: dict[str, Path], overlap: bool
) -> None:
    """A bfloat16 engine attends with the kernel (the Qwen3 checkpoint's heads of 32
    elements; the default model's 16 are not the bfloat16 kernel's shape): on a CPU
    with AVX512-BF16 its bfloat16 kernel, elsewhere the float32 one over widened
    operands. Its decode trace replays the op: the same greedy tokens as eager steps.
    (Its numbers against float64 attention are the op tests above; against the
    products, bfloat16 rounds the weights differently, so greedy tokens of a random
    model part after a few steps.)"""
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randint(4, 250, (n,), generator=gen).tolist() for n in (5, 30, 12, 61)]
    outputs = []
    for trace in (True, False):
        engine = Engine(
            device="cpu",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            disable_progress_bar=True,
            model_path=str(checkpoints["qwen3"]),
            disable_decode_trace=not trace,
            disable_overlap_schedule=not overlap,
        )
        try:
            runner = engine.scheduler.runner
            assert runner.attention.decode_kernel  # AVX512-BF16, or float32 widened
            params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
            results = engine.generate(input_ids=inputs, sampling_params=params)
            outputs.append([r["output_ids"] for r in results])
            if trace:
                assert runner.decode_trace is not None
                assert runner.decode_trace.replays > 0
        finally:
            engine.shutdown()
    replayed, eager = outputs
    assert [len(ids) for ids in replayed] == [24] * len(inputs)
    assert replayed == eager


def _store_operands(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A step of 5 tokens, 3 KV heads of 16: its K (contiguous) and V (a view into a
    wider projection output, as the engine's are), a 40-slot cache and a 2-request
    stage of capacity 9 per layer, and where each new row goes (strided views)."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 * 48, generator=gen).to(dtype)
    return {
        "k": qkv[:, 48:96].reshape(5, 3, 16).clone(),
        "v": qkv[:, 96:144].view(5, 3, 16),
        "k_cache": torch.zeros(40, 3, 16, dtype=dtype),
        "v_cache": torch.zeros(40, 3, 16, dtype=dtype),
        "loc": torch.tensor([7, 0, 0, 0, 39, 0, 12, 0, 13])[::2],  # strided, as a verify's
        "k_stage": torch.zeros(2, 3, 9, 16, dtype=dtype),
        "v_stage": torch.zeros(2, 3, 9, 16, dtype=dtype),
        "append": torch.randperm(2 * 3 * 9, generator=gen)[:30:2],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("staged", [True, False], ids=["stage", "cache-only"])
def test_store_kv_writes_what_index_copy_writes(
    kernel_dir: Path, dtype: torch.dtype, staged: bool
) -> None:
    """``store_kv`` (one pass over a step's new rows) leaves the cache and the stage
    exactly as ``write_kv_buffers`` and ``append_to_stage`` (four ``index_copy_``) do."""
    ops = _store_operands(dtype)
    want = {name: t.clone() for name, t in ops.items()}
    want["k_cache"].index_copy_(0, ops["loc"], ops["k"])
    want["v_cache"].index_copy_(0, ops["loc"], ops["v"])
    stage = (ops["k_stage"], ops["v_stage"], ops["append"]) if staged else (None, None, None)
    if staged:
        append_to_stage(want["k_stage"], ops["append"], ops["k"])
        append_to_stage(want["v_stage"], ops["append"], ops["v"])
    torch.ops.tandem.store_kv(
        ops["k"], ops["v"], ops["k_cache"], ops["v_cache"], ops["loc"], *stage
    )
    for name in ("k_cache", "v_cache", "k_stage", "v_stage"):
        assert torch.equal(ops[name], want[name]), name
    assert ops["v_cache"][39].abs().sum() > 0  # the last slot was written


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loc": torch.tensor([7, 0, 40, 12, 13])}, "slot 40 is outside the cache's 40"),
        ({"loc": torch.tensor([7, 0, -1, 12, 13])}, "slot -1 is outside"),
        ({"append": torch.tensor([54] + [0] * 14)}, "stage row 54 is outside the stage's 54"),
        ({"append": torch.zeros(14, dtype=torch.int64)}, "append is an int64 [T * Hkv]"),
        ({"loc": torch.tensor([7, 0, 39, 12, 13], dtype=torch.int32)}, "loc is an int64 [T]"),
        ({"loc": torch.tensor([7, 0, 39, 12])}, "T = 5, got [4]"),
        ({"k": torch.zeros(5, 3, 16, dtype=torch.float64)}, "one dtype"),
        ({"v_cache": torch.zeros(40, 2, 16)}, "the caches [S, Hkv, D]"),
        ({"v_stage": None}, "come together"),
        ({"k_stage": torch.zeros(2, 3, 9, 32)}, "contiguous [B, Hkv, capacity, D]"),
    ],
)
def test_store_kv_refuses_and_writes_nothing(
    kernel_dir: Path, change: dict[str, Any], message: str
) -> None:
    ops = _store_operands(torch.float32)
    ops.update(change)
    before = {name: t.clone() for name, t in ops.items() if t is not None}
    order = ("k", "v", "k_cache", "v_cache", "loc", "k_stage", "v_stage", "append")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.tandem.store_kv(*(ops[name] for name in order))
    for name in ("k_cache", "v_cache", "k_stage", "v_stage"):
        if ops[name] is not None:
            assert torch.equal(ops[name], before[name]), name


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_engine_tokens_with_store_kv_equal_tokens_with_index_copy(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """An engine writing K/V with ``store_kv`` (eagerly and in its decode trace) makes
    the tokens of one writing them with ``index_copy_``, with the stage checked
    against the paged cache at every step (``TANDEM_DEBUG_FUTURES`` in the tests)."""
    with_op, engine = _tokens(kernel=True, overlap=overlap)
    trace = engine.scheduler.runner.decode_trace
    assert trace is not None
    assert trace.replays > 0
    calls: list[bool] = []

    def counted(*args: Any) -> bool:
        calls.append(True)
        return False

    monkeypatch.setattr(attention_base, "native_store", counted)
    monkeypatch.setattr(torch_backend, "native_store", counted)
    with_index_copy, _ = _tokens(kernel=True, overlap=overlap)
    assert calls  # the engine asked, and wrote with index_copy_
    assert with_op == with_index_copy
