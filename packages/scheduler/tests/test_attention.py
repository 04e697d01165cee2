"""Attention backends against each other and against a plain reference: paged prefill
with prefixes, decode, page sizes, GQA. The torch backend runs everywhere; FlashInfer
is checked on CUDA machines."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from tandem.scheduler.attention import HeadShape, create_attention_backend
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool, ReqToTokenPool

HEADS, KV_HEADS, DIM = 4, 2, 16


def _setup(device: str, page_size: int) -> tuple[PagedKVPool, ReqToTokenPool]:
    layout = KVLayout(1, KV_HEADS, DIM, torch.float32)
    return PagedKVPool(64, page_size, layout, device), ReqToTokenPool(4, 128, device)


def _batch(
    kv: PagedKVPool,
    pool: ReqToTokenPool,
    prefix: list[int],
    extend: list[int],
    device: str,
    mode: ForwardMode | None = None,
) -> ForwardBatch:
    """Give each request pages for its whole sequence and write its table row. The
    mode defaults to DECODE when every request brings one token, else PREFILL."""
    rows, locs = [], []
    for p, e in zip(prefix, extend, strict=True):
        row = pool.alloc()
        assert row is not None
        pages = kv.alloc_pages(kv.pages_for(p + e))
        assert pages is not None
        slots = kv.slots(pages, 0, p + e)
        pool.req_to_token[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32, device=device)
        rows.append(row)
        locs.extend(slots[p:])
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    if mode is None:
        mode = ForwardMode.DECODE if all(e == 1 for e in extend) else ForwardMode.PREFILL
    positions = [p + j for p, e in zip(prefix, extend, strict=True) for j in range(e)]
    return ForwardBatch(
        mode, t([0] * sum(extend)), t(positions), t(rows), t(seq), t(prefix), t(extend),
        t(locs), seq, list(extend),
    )  # fmt: skip


def _reference(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    prefix: list[int],
    extend: list[int],
) -> torch.Tensor:
    out, start = [], 0
    for k, v, p, e in zip(keys, values, prefix, extend, strict=True):
        qi = q[start : start + e].transpose(0, 1)  # [H, e, D]
        ki = k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        vi = v.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        mask = (
            torch.arange(p + e, device=q.device)[None, :]
            <= (p + torch.arange(e, device=q.device))[:, None]
        )
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=DIM**-0.5)
        out.append(o.transpose(0, 1).reshape(e, HEADS * DIM))
        start += e
    return torch.cat(out)


def _run(
    backend_name: str, device: str, page_size: int, prefix: list[int], extend: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    kv, pool = _setup(device, page_size)
    heads = HeadShape(HEADS, KV_HEADS, DIM, DIM**-0.5, torch.float32)
    # Write each request's prefix K/V first, then attend with the new tokens.
    keys = [
        torch.randn(p + e, KV_HEADS, DIM, generator=gen).to(device)
        for p, e in zip(prefix, extend, strict=True)
    ]
    values = [
        torch.randn(p + e, KV_HEADS, DIM, generator=gen).to(device)
        for p, e in zip(prefix, extend, strict=True)
    ]
    q = torch.randn(sum(extend), HEADS, DIM, generator=gen).to(device)
    batch = _batch(kv, pool, prefix, extend, device)
    slots = pool.req_to_token[batch.rows].long()
    for i, (p, _e) in enumerate(zip(prefix, extend, strict=True)):
        kv.k_buffer(0)[slots[i, :p]] = keys[i][:p]
        kv.v_buffer(0)[slots[i, :p]] = values[i][:p]
    backend = create_attention_backend(
        backend_name, kv, pool.req_to_token, torch.device(device), heads
    )
    backend.plan(batch)
    new_k = torch.cat([k[p:] for k, p in zip(keys, prefix, strict=True)])
    new_v = torch.cat([v[p:] for v, p in zip(values, prefix, strict=True)])
    got = backend.forward(0, q, new_k, new_v, DIM**-0.5)
    return got, _reference(q, keys, values, prefix, extend)


CASES = [([0, 0, 0], [5, 1, 9]), ([3, 0, 17], [4, 6, 2]), ([7, 12, 1], [1, 1, 1])]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("prefix", "extend"), CASES)
def test_torch_backend_matches_reference(
    page_size: int, prefix: list[int], extend: list[int]
) -> None:
    got, ref = _run("torch", "cpu", page_size, prefix, extend)
    assert got.shape == (sum(extend), HEADS * DIM)
    assert (got - ref).abs().max().item() < 1e-5


def test_unknown_backend_and_wrong_device_are_named() -> None:
    kv, pool = _setup("cpu", 1)
    heads = HeadShape(HEADS, KV_HEADS, DIM, 1 / math.sqrt(DIM), torch.float32)
    with pytest.raises(ValueError, match="unknown attention_backend 'nope'"):
        create_attention_backend("nope", kv, pool.req_to_token, torch.device("cpu"), heads)
    with pytest.raises(ValueError, match=r"flashinfer.*CUDA"):
        create_attention_backend("flashinfer", kv, pool.req_to_token, torch.device("cpu"), heads)


@pytest.mark.cuda
@pytest.mark.skipif(
    # Only on a GPU machine: without a GPU the cuda marker is the reason.
    torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer-python is not installed (an optional extra: tandem-scheduler[cuda])",
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("prefix", "extend"), CASES)
def test_flashinfer_matches_torch_backend(
    page_size: int, prefix: list[int], extend: list[int]
) -> None:
    got, ref = _run("flashinfer", "cuda", page_size, prefix, extend)
    torch_got, _ = _run("torch", "cuda", page_size, prefix, extend)
    assert (got.float() - ref).abs().max().item() < 2e-3
    assert (got.float() - torch_got).abs().max().item() < 2e-3
