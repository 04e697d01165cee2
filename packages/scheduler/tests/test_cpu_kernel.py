"""The CPU decode kernel (``torch.ops.tandem.decode_attention``, built from
``attention/cpu_decode.cpp``): its output against float64 SDPA at every head size it
specializes and one it does not, with masked keys, key counts that are not a multiple
of its four-key blocks and the gathered pages' strides; the bad inputs it refuses; the
build's cache and its fallback to SDPA; and an engine's tokens with the kernel equal to
its tokens with SDPA, in both loops, through the decode trace."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.scheduler import Engine
from tandem.scheduler.attention import cpu_kernel
from tandem.scheduler.attention.torch_backend import _grouped_decode, _kernel_fits
from tandem.scheduler.default_model import cache_root


@pytest.fixture(scope="module")
def kernel_dir() -> Path:
    """Where engines keep the kernel: one registration per process, so this module
    loads the build the engines (in this process or another) load."""
    path = cache_root() / "kernels"
    assert cpu_kernel.load_cpu_kernels(path)
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


@pytest.mark.parametrize("dim", [16, 32, 64, 128, 48])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_kernel_equals_float64_attention(kernel_dir: Path, dim: int, group: int) -> None:
    gen = torch.Generator().manual_seed(dim * 10 + group)
    kv_heads, lens = 2, [1, 7, 33, 30, 4]
    length = max(lens)  # 33: one key past the last four-key block
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
    out = _grouped_decode(q, k, v, bias, 0.125, kernel=True)
    expected = _grouped_decode(q, k, v, bias, 0.125, kernel=False)
    assert (out - expected).abs().max().item() < 2e-6


def test_kernel_refuses_what_it_cannot_attend(kernel_dir: Path) -> None:
    k = torch.randn(2, 2, 8, 16)
    q, bias = torch.randn(2, 4, 16), torch.zeros(2, 1, 1, 8)
    op = torch.ops.tandem.decode_attention
    with pytest.raises(RuntimeError, match="float32"):
        op(q.bfloat16(), k.bfloat16(), k.bfloat16(), bias.bfloat16(), 0.25)
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.randn(2, 3, 16), k, k, bias, 0.25)  # 3 heads over 2 KV heads
    with pytest.raises(RuntimeError, match="same strides"):
        op(q, k, k.contiguous().transpose(2, 3).contiguous().transpose(2, 3), bias, 0.25)
    with pytest.raises(RuntimeError, match="bias"):
        op(q, k, k, torch.zeros(2, 1, 1, 7), 0.25)


def test_bfloat16_keeps_its_matrix_products(kernel_dir: Path) -> None:
    k = torch.randn(1, 1, 8, 16)
    q = torch.randn(1, 3, 16)
    assert _kernel_fits(q, k, k)
    assert not _kernel_fits(q.bfloat16(), k.bfloat16(), k.bfloat16())
    assert not _kernel_fits(q, k, k.transpose(2, 3).contiguous().transpose(2, 3))
    bias = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    qb, kb = q.bfloat16(), k.bfloat16()
    out = _grouped_decode(qb, kb, kb, bias, 0.25, kernel=True)
    assert torch.equal(out, _grouped_decode(qb, kb, kb, bias, 0.25, kernel=False))


def test_a_build_is_kept_and_loaded_again(
    kernel_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = cpu_kernel._compiler()
    assert compiler is not None
    built = cpu_kernel.library_path(kernel_dir, compiler, cpu_kernel._flags())
    assert built.is_file()
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernel, "loaded", lambda: False)  # as a new process would
    monkeypatch.setattr(cpu_kernel, "_build", lambda *args: pytest.fail("built again"))
    assert cpu_kernel.load_cpu_kernels(kernel_dir)
    assert built.stat().st_mtime_ns == stamp
    # Another source, torch, compiler or flag set is another file.
    assert cpu_kernel.library_path(kernel_dir, compiler, [*cpu_kernel._flags(), "-g"]) != built


def test_without_a_compiler_or_with_a_failing_one_sdpa_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernel, "loaded", lambda: False)
    monkeypatch.setattr(cpu_kernel, "COMPILERS", ("tandem-no-such-compiler",))
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert not cpu_kernel.load_cpu_kernels(tmp_path)
    assert "no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_kernel, "COMPILERS", ("false",))  # exits 1, builds nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert not cpu_kernel.load_cpu_kernels(tmp_path)
    assert "CPU kernels not built" in caplog.text
    assert not list(tmp_path.glob("*.so"))


def test_a_build_that_times_out_is_a_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout", 0))

    monkeypatch.setattr(cpu_kernel, "loaded", lambda: False)
    monkeypatch.setattr(cpu_kernel.subprocess, "run", slow)
    assert not cpu_kernel.load_cpu_kernels(tmp_path)


INPUTS = [[(13 * i + 7 * j) % 250 + 4 for j in range(5 + 11 * i)] for i in range(6)]
MAX_NEW = [3, 70, 21, 150, 9, 44]


def _tokens(kernel: bool, overlap: bool) -> tuple[list[list[int]], Engine]:
    engine = Engine(
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


def test_bfloat16_engines_attend_without_the_kernel() -> None:
    engine = Engine(device="cpu", dtype="bfloat16", skip_tokenizer_init=True)
    try:
        assert not engine.scheduler.runner.attention.decode_kernel
    finally:
        engine.shutdown()
