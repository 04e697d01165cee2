"""The torch backend's CPU decode path (SDPA over KV heads with the query heads of a
group as query rows, and an additive mask built in the plan) against a plain
per-request SDPA reference and against the backend's general path: unequal sequence
lengths, GQA, MQA and plain multi-head attention, fp32 and half precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention import _batch

from tandem.scheduler.attention.torch_backend import TorchAttention, _Plan
from tandem.scheduler.forward_batch import ForwardBatch
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool, ReqToTokenPool

HEADS, DIM, LAYERS, PAGE = 4, 16, 2, 4
SCALE = DIM**-0.5
# One request longer than SDPA's 512-key CPU tile, so the short requests' second tile
# is all padding; one request with no prefix at all (it sees only its own new key).
SEQ_LENS = [3, 700, 150, 1]
# Every slot a request does not own holds this: a padded key given any weight would
# dominate its scores and show in the output.
POISON = 30.0


def _setup(
    num_kv_heads: int, dtype: torch.dtype, device: str
) -> tuple[TorchAttention, ForwardBatch, list[list[torch.Tensor]], torch.Tensor]:
    """A decode batch over ``SEQ_LENS`` with random prefix K/V in every layer.

    Returns the backend, the batch, per layer ``[keys, values]`` of every request's
    whole sequence as one ``[sum(seq), Hkv, D]`` pair (the new tokens' K/V at each
    request's last position, for ``forward`` to write) and the ``[B, H, D]`` queries."""
    gen = torch.Generator().manual_seed(num_kv_heads)
    pages = sum(-(-s // PAGE) for s in SEQ_LENS) + 1
    kv = PagedKVPool(pages, PAGE, KVLayout(LAYERS, num_kv_heads, DIM, dtype), device)
    pool = ReqToTokenPool(len(SEQ_LENS), max(SEQ_LENS), device)
    batch = _batch(kv, pool, [s - 1 for s in SEQ_LENS], [1] * len(SEQ_LENS), device)
    slots = pool.req_to_token[batch.rows].long()
    layers = []
    for layer in range(LAYERS):
        kv.k_buffer(layer).fill_(POISON)
        kv.v_buffer(layer).fill_(POISON)
        kvs = [torch.randn(sum(SEQ_LENS), num_kv_heads, DIM, generator=gen) for _ in "kv"]
        start = 0
        for i, s in enumerate(SEQ_LENS):
            for buf, x in zip((kv.k_buffer(layer), kv.v_buffer(layer)), kvs, strict=True):
                buf[slots[i, : s - 1]] = x[start : start + s - 1].to(device, dtype)
            start += s
        layers.append([x.to(device, dtype) for x in kvs])
    q = torch.randn(len(SEQ_LENS), HEADS, DIM, generator=gen).to(device, dtype)
    return TorchAttention(kv, pool.req_to_token), batch, layers, q


def _new_tokens(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``[sum(seq), ...]`` at each request's last position."""
    ends = torch.tensor(SEQ_LENS).cumsum(0) - 1
    return x[ends.to(x.device)]


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each request's query over its own keys alone (no padding, no mask), in fp32."""
    out, start = [], 0
    group = HEADS // keys.shape[1]
    for i, s in enumerate(SEQ_LENS):
        k = keys[start : start + s].float().repeat_interleave(group, 1).transpose(0, 1)
        v = values[start : start + s].float().repeat_interleave(group, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v, scale=SCALE)
        out.append(o.reshape(HEADS * DIM))
        start += s
    return torch.stack(out)


def _plan_of(backend: TorchAttention) -> _Plan:
    plan = backend._plan
    assert plan is not None
    return plan


def _decode(
    backend: TorchAttention, layers: list[list[torch.Tensor]], q: torch.Tensor
) -> list[torch.Tensor]:
    """``forward`` of every layer after one plan; outputs per layer."""
    return [
        backend.forward(layer, q, _new_tokens(k), _new_tokens(v), SCALE)
        for layer, (k, v) in enumerate(layers)
    ]


@pytest.mark.parametrize(
    ("num_kv_heads", "dtype", "atol"),
    [
        (2, torch.float32, 1e-5),
        (1, torch.float32, 1e-5),
        (4, torch.float32, 1e-5),
        (2, torch.bfloat16, 3e-2),
        (2, torch.float16, 5e-3),
    ],
)
def test_cpu_decode_matches_reference(num_kv_heads: int, dtype: torch.dtype, atol: float) -> None:
    backend, batch, layers, q = _setup(num_kv_heads, dtype, "cpu")
    backend.plan(batch)
    assert _plan_of(backend).grouped_decode
    for got, (k, v) in zip(_decode(backend, layers, q), layers, strict=True):
        assert got.dtype == dtype
        assert got.shape == (len(SEQ_LENS), HEADS * DIM)
        assert torch.isfinite(got).all()
        assert (got.float() - _reference(q, k, v)).abs().max().item() < atol


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_cpu_decode_matches_boolean_mask_path(num_kv_heads: int) -> None:
    """The same batch through ``plan_masked`` (the general path: SDPA over ``[B, H, 1,
    D]`` with a boolean mask) agrees to fp32 rounding."""
    backend, batch, layers, q = _setup(num_kv_heads, torch.float32, "cpu")
    backend.plan(batch)
    grouped = _decode(backend, layers, q)
    kv_slots = backend.req_to_token[batch.rows, : max(SEQ_LENS)].long()
    mask = torch.arange(max(SEQ_LENS)) < batch.seq_lens.view(-1, 1)
    backend.plan_masked(kv_slots, mask.unsqueeze(1), batch.out_cache_loc)
    assert not _plan_of(backend).grouped_decode
    for a, b in zip(grouped, _decode(backend, layers, q), strict=True):
        assert (a - b).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_decode_takes_the_grouped_path(dtype: torch.dtype) -> None:
    """Prefill and mixed batches keep the general SDPA path, on the CPU with their
    causal mask as additive floats in the cache's dtype (0 or -inf, never a row all
    -inf), which SDPA's CPU kernel attends as it would the boolean mask, faster in
    bfloat16."""
    for prefix, extend in (([0, 2], [5, 3]), ([4, 0, 6], [1, 3, 1])):
        kv = PagedKVPool(16, PAGE, KVLayout(1, 2, DIM, dtype), "cpu")
        pool = ReqToTokenPool(4, 32, "cpu")
        backend = TorchAttention(kv, pool.req_to_token)
        backend.plan(_batch(kv, pool, prefix, extend, "cpu"))
        plan = _plan_of(backend)
        assert not plan.grouped_decode
        assert plan.mask.dtype == dtype
        allowed = plan.mask == 0
        assert (allowed | (plan.mask == float("-inf"))).all()
        assert allowed.any(-1).all()
        for i, (p, n) in enumerate(zip(prefix, extend, strict=True)):
            for j in range(n):  # query j of request i sees keys 0 .. p + j
                keys = allowed[i, 0, j].nonzero().flatten().tolist()
                assert keys == list(range(p + j + 1))


@pytest.mark.cuda
def test_cuda_decode_keeps_the_boolean_mask_path() -> None:
    """The grouped layout is measured on the CPU only: CUDA decode keeps the general
    path, and still matches the reference."""
    backend, batch, layers, q = _setup(2, torch.float32, "cuda")
    backend.plan(batch)
    assert not _plan_of(backend).grouped_decode
    for got, (k, v) in zip(_decode(backend, layers, q), layers, strict=True):
        assert (got - _reference(q, k, v)).abs().max().item() < 1e-4
