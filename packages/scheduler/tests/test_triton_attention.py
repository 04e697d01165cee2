"""The ``triton`` attention backend against the ``torch`` backend on the same KV pool:
decode (page sizes, GQA ratios, head dims, KV splits), extend with and without
prefixes, mixed batches, masked (tree) attention, and an Engine's greedy tokens.

Without a GPU the kernels run in Triton's interpreter: ``conftest.py`` sets
``TRITON_INTERPRET=1`` before anything imports Triton (Triton picks interpreter or
compiler when a kernel is decorated, once per process). With a GPU they are compiled,
and only the GPU cases run: one process cannot hold both kinds of kernel.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from test_attention import _batch

from tandem.scheduler import Engine, attention
from tandem.scheduler.attention import HeadShape, create_attention_backend
from tandem.scheduler.attention.torch_backend import TorchAttention
from tandem.scheduler.attention.triton_backend import TritonAttention
from tandem.scheduler.forward_batch import ForwardMode
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool, ReqToTokenPool
from tandem.scheduler.models.tiny import default_model_path

# The CPU runs the interpreter only where no GPU compiled the kernels.
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)]
if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES = ["cpu", *DEVICES]
# bf16 runs on the GPU only: Triton 3.6's interpreter computes tl.dot of bf16 blocks
# wrongly (fp16 is right), so on the CPU it would test the interpreter.
LOW_DTYPES = [
    pytest.param(torch.float16, id="float16"),
    pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bfloat16"),
]
HEADS = 4


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _pools(
    device: str, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[PagedKVPool, ReqToTokenPool]:
    layout = KVLayout(1, kv_heads, head_dim, dtype)
    kv = PagedKVPool(512 // page_size + 1, page_size, layout, device)
    # Every slot holds random K/V, padding and free ones too: reading a slot that is not
    # the request's shows up as a mismatch.
    gen = torch.Generator().manual_seed(1)
    for buf in (kv.k_buffer(0), kv.v_buffer(0)):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    return kv, ReqToTokenPool(6, 512, device)


def _qkv(
    tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one fused projection, like the model's."""
    gen = torch.Generator().manual_seed(2)
    width = (HEADS + 2 * kv_heads) * head_dim
    fused = torch.randn(tokens, width, generator=gen).to(device=device, dtype=dtype)
    q, k, v = fused.split([HEADS * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return (
        q.view(tokens, HEADS, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


def _compare(
    device: str,
    prefix: list[int],
    extend: list[int],
    *,
    mode: ForwardMode,
    page_size: int = 1,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    num_kv_splits: int = 3,
) -> None:
    kv, pool = _pools(device, page_size, kv_heads, head_dim, dtype)
    batch = _batch(kv, pool, prefix, extend, device, mode)
    q, k, v = _qkv(sum(extend), kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    heads = HeadShape(HEADS, kv_heads, head_dim, scale, dtype)
    reference = TorchAttention(kv, pool.req_to_token)
    reference.plan(batch)
    want = reference.forward(0, q, k, v, scale)
    backend = TritonAttention(kv, pool.req_to_token, heads, num_kv_splits=num_kv_splits)
    backend.plan(batch)
    got = backend.forward(0, q, k, v, scale)
    assert got.shape == want.shape
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() < _tolerance(dtype)


# Decode: a one-token sequence (all but one split empty), short ones, and one long
# enough that a split of 3 covers several key blocks.
DECODE_PREFIX = [0, 6, 40, 199]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_matches_torch(device: str, page_size: int, kv_heads: int, head_dim: int) -> None:
    _compare(
        device, DECODE_PREFIX, [1] * 4, mode=ForwardMode.DECODE, page_size=page_size,
        kv_heads=kv_heads, head_dim=head_dim,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_splits", [1, 8])
def test_decode_split_counts(device: str, num_kv_splits: int) -> None:
    _compare(device, [0, 13, 150], [1] * 3, mode=ForwardMode.DECODE, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_low_precision(device: str, dtype: torch.dtype, head_dim: int) -> None:
    _compare(
        device, DECODE_PREFIX, [1] * 4, mode=ForwardMode.DECODE, page_size=16,
        head_dim=head_dim, dtype=dtype, num_kv_splits=8,
    )  # fmt: skip


EXTEND_CASES = [
    pytest.param([0, 0, 0], [5, 1, 9], id="no-prefix"),
    pytest.param([3, 0, 17], [4, 6, 2], id="prefixes"),
    # Several query blocks and key blocks per request.
    pytest.param([70, 0], [40, 100], id="long"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("prefix", "extend"), EXTEND_CASES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_matches_torch(
    device: str, prefix: list[int], extend: list[int], page_size: int
) -> None:
    _compare(device, prefix, extend, mode=ForwardMode.PREFILL, page_size=page_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 80), (4, 16)])
def test_mixed_prefill_then_decode_matches_torch(device: str, kv_heads: int, head_dim: int) -> None:
    _compare(
        device, [0, 5, 20, 9], [7, 3, 1, 1], mode=ForwardMode.MIXED, kv_heads=kv_heads,
        head_dim=head_dim, page_size=4,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_extend_low_precision(device: str, dtype: torch.dtype, head_dim: int) -> None:
    _compare(
        device, [70, 0, 5], [40, 100, 1], mode=ForwardMode.MIXED, page_size=16,
        head_dim=head_dim, dtype=dtype,
    )  # fmt: skip


def _tree_mask(batch: int, prefix: int, queries: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, Q, prefix + Q]``: each query sees a random part of the prefix, its
    ancestors in a random tree and itself; query 0 of request 0 sees only itself, so
    its first key block has no live key."""
    mask = torch.zeros(batch, queries, prefix + queries, dtype=torch.bool)
    mask[:, :, :prefix] = torch.rand(batch, queries, prefix, generator=gen) < 0.5
    for b in range(batch):
        parent = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, queries)]
        for i in range(queries):
            node = i
            while node >= 0:
                mask[b, i, prefix + node] = True
                node = parent[node]
    mask[0, 0, :prefix] = False
    return mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_DTYPES])
def test_masked_tree_matches_torch(device: str, dtype: torch.dtype) -> None:
    batch, prefix, queries, kv_heads, head_dim = 2, 70, 5, 2, 80
    kv, pool = _pools(device, 4, kv_heads, head_dim, dtype)
    fb = _batch(kv, pool, [prefix] * batch, [queries] * batch, device, ForwardMode.SPEC_DECODE)
    kv_slots = pool.req_to_token[fb.rows, : prefix + queries].long()
    mask = _tree_mask(batch, prefix, queries, torch.Generator().manual_seed(3)).to(device)
    q, k, v = _qkv(batch * queries, kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    reference = TorchAttention(kv, pool.req_to_token)
    reference.plan_masked(kv_slots, mask, fb.out_cache_loc)
    want = reference.forward(0, q, k, v, scale)
    heads = HeadShape(HEADS, kv_heads, head_dim, scale, dtype)
    backend = TritonAttention(kv, pool.req_to_token, heads)
    backend.plan_masked(kv_slots, mask, fb.out_cache_loc)
    got = backend.forward(0, q, k, v, scale)
    assert (got.float() - want.float()).abs().max().item() < _tolerance(dtype)
    with pytest.raises(ValueError, match="disagree"):
        backend.plan_masked(kv_slots[:, :-1], mask, fb.out_cache_loc)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_plan_reads_only_device_tensors(device: str) -> None:
    """What a CUDA graph replay relies on: after planning with one batch's tensors,
    writing another batch's rows and lengths into the same tensors changes the result,
    whatever the host lists say."""
    kv, pool = _pools(device, 1, 2, 64, torch.float32)
    first = _batch(kv, pool, [3, 9], [1, 1], device, ForwardMode.DECODE)
    second = _batch(kv, pool, [30, 1], [1, 1], device, ForwardMode.DECODE)
    heads = HeadShape(HEADS, 2, 64, 0.125, torch.float32)
    backend = TritonAttention(kv, pool.req_to_token, heads)
    assert backend.supports_cuda_graph
    assert not TorchAttention.supports_cuda_graph
    first.seq_lens_cpu = first.extend_lens_cpu = [-1, -1]
    backend.plan(first)
    for name in ("rows", "seq_lens", "out_cache_loc"):
        getattr(first, name).copy_(getattr(second, name))
    q, k, v = _qkv(2, 2, 64, torch.float32, device)
    got = backend.forward(0, q, k, v, 0.125)
    reference = TorchAttention(kv, pool.req_to_token)
    reference.plan(second)
    want = reference.forward(0, q, k, v, 0.125)
    assert (got - want).abs().max().item() < 1e-5


def test_default_backend_is_triton_on_gpus_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert attention.default_backend(torch.device("cpu")) == "torch"
    assert attention.default_backend(torch.device("cuda")) == "triton"  # ROCm too
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert attention.default_backend(torch.device("cuda")) == "torch"


def test_cpu_without_the_interpreter_and_missing_triton_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv, pool = _pools("cpu", 1, 2, 16, torch.float32)
    heads = HeadShape(HEADS, 2, 16, 0.25, torch.float32)
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    message = (
        "attention_backend='triton' needs a CUDA or ROCm device (on a CPU it runs only "
        "under TRITON_INTERPRET=1, for tests), got cpu"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        create_attention_backend("triton", kv, pool.req_to_token, cpu, heads)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs the 'triton' package"):
        create_attention_backend("triton", kv, pool.req_to_token, cpu, heads)


def test_importing_the_package_does_not_import_triton() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tandem.scheduler.attention, tandem.scheduler; "
        "sys.exit('triton' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_path(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("device", DEVICES)
def test_engine_greedy_tokens_equal_torch_backend(default_model: Path, device: str) -> None:
    prompts = [[5, 17, 42, 99, 3, 250, 11], [7, 8]]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    outputs = {}
    for backend in ("torch", "triton"):
        with Engine(
            model_path=str(default_model), device=device, dtype="float32",
            attention_backend=backend, max_total_tokens=256, max_running_requests=4,
            context_length=128,
        ) as engine:  # fmt: skip
            assert engine.get_server_info()["attention_backend"] == backend
            outputs[backend] = [
                r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)
            ]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_rotary_matches_apply_rotary(device: str, head_dim: int, dtype: torch.dtype) -> None:
    """The one-launch rotary kernel computes ``apply_rotary``'s float32 formula exactly,
    for head counts and head dims that are not powers of two."""
    from tandem.scheduler.kernels.triton_rope import rotary
    from tandem.scheduler.models.rope import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(device)
    positions = torch.tensor([0, 3, 511, 4095, 17], device=device)
    cos, sin = rope(positions)
    generator = torch.Generator().manual_seed(head_dim)
    x = torch.randn(5, 6, head_dim, generator=generator).to(device, dtype)
    # The GPU may fuse the multiply-add (FMA): equal up to float32 rounding.
    torch.testing.assert_close(rotary(x, cos, sin), apply_rotary(x, cos, sin))
