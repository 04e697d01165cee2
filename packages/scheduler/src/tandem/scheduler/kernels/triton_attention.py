"""Triton kernels of the ``triton`` attention backend, with their launchers.

Every kernel reads K/V in place from the paged KV pool, through the request-to-token
table or, for masked attention, an explicit ``[B, K]`` slot table, with an online
softmax in fp32. ``decode_attention`` splits each request's keys into KV splits merged
by a reduce kernel and reads no host lengths (CUDA-graph capturable);
``extend_attention`` (prefill, mixed) and ``masked_attention`` (speculative trees) run
over blocks of queries. Importing this module imports Triton; on a CPU (tests only),
``TRITON_INTERPRET=1`` must be set first. See docs/guides/adding-an-attention-backend.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Under the interpreter the key loops run as ``while`` loops: Triton 3.6's interpreter
# cannot take a loaded length as a ``range`` bound with NumPy >= 2.4
# (triton-lang/triton#9171). Compiled kernels keep ``for`` loops, which Triton
# software-pipelines; both run the same loop body. Fixed when the kernels are
# decorated, like Triton's own choice of interpreter; a constexpr, the only kind of
# global a kernel may read.
WHILE_LOOPS = tl.constexpr(bool(triton.knobs.runtime.interpret))
# Decode: keys per iteration of a split. Extend/masked: the block shapes come from
# _tile_shape, by head_dim.
DECODE_BLOCK_N = 64


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; lanes past head_dim are masked off.
    return max(16, triton.next_power_of_2(head_dim))


def _tile_shape(head_dim: int, queries: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` for extend/masked. 16-bit inputs: 64 x 64 tiles up to
    head_dim 64, narrower key blocks up to 128 and narrower query blocks beyond; fp32
    inputs take half the key block. That keeps the pipelined k and v tiles within the
    smallest shared memory they meet (64 KiB of LDS on AMD Instinct, 99 KiB on
    consumer NVIDIA parts) up to head_dim 256. A short query run (a mixed batch of
    small chunks, a small draft tree) gets a smaller query block rather than
    mostly-masked rows."""
    block_d = _block_d(head_dim)
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    if dtype.itemsize >= 4:
        block_n //= 2
    block_m = min(block_m, max(16, triton.next_power_of_2(max(queries, 1))))
    return block_m, block_n


# -- decode ----------------------------------------------------------------------------


@triton.jit
def _decode_step(
    start, hi, q, K, V, Table, row, kv_head, m_i, l_i, acc, qk_scale,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_table, d, d_ok,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold keys ``start .. start + BLOCK_N - 1`` (those below ``hi``) of one row into
    the running (max, sum, output) of a decode query. The block has at least one live
    key, so the new max is finite."""
    pos = start + tl.arange(0, BLOCK_N)
    n_ok = pos < hi
    slot = tl.load(Table + row * stride_table + pos, mask=n_ok, other=0).to(tl.int64)
    tile_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(
        K + slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=tile_ok, other=0.0
    ).to(tl.float32)
    s = tl.sum(k * q[None, :], 1) * qk_scale
    s = tl.where(n_ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    v = tl.load(
        V + slot[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=tile_ok, other=0.0
    ).to(tl.float32)
    acc = acc * alpha + tl.sum(p[:, None] * v, 0)
    l_i = l_i * alpha + tl.sum(p, 0)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q, K, V, Table, Rows, SeqLens, PartAcc, PartLse,
    qk_scale,
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_table,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (request, query head, split): attention of the request's one query over
    its split's share of keys, written as a normalized partial output and its
    log2-sum-exp (``-inf`` for an empty split)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = h // GROUP
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int64)
    per_split = tl.cdiv(seq_len, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if WHILE_LOOPS:
        start = lo
        while start < hi:
            m_i, l_i, acc = _decode_step(
                start, hi, q, K, V, Table, row, kv_head, m_i, l_i, acc, qk_scale,
                stride_kn, stride_kh, stride_vn, stride_vh, stride_table, d, d_ok, BLOCK_N,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _decode_step(
                start, hi, q, K, V, Table, row, kv_head, m_i, l_i, acc, qk_scale,
                stride_kn, stride_kh, stride_vn, stride_vh, stride_table, d, d_ok, BLOCK_N,
            )  # fmt: skip

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    base = b.to(tl.int64) * stride_pb + h * stride_ph + split * stride_ps
    tl.store(PartAcc + base + d, out, mask=d_ok)
    tl.store(PartLse + b.to(tl.int64) * stride_lb + h * stride_lh + split, lse)


@triton.jit
def _decode_reduce_kernel(
    PartAcc, PartLse, Out,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (request, query head): the splits' partial outputs weighted by their share
    of the total softmax mass. A request with no keys at all (never a real one) gets
    zeros rather than NaN."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    live = lse > float("-inf")
    w = tl.where(live, tl.exp2(lse - tl.where(live, top, 0.0)), 0.0)
    part = tl.load(
        PartAcc + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    part_acc: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
) -> None:
    """Decode attention into ``out`` (``[B, H, D]``, q's dtype): request ``b``'s one
    query ``q[b]`` over the keys at positions ``0 .. seq_lens[b] - 1`` of row
    ``rows[b]``. ``part_acc`` (``[B, H, S, D]`` fp32) and ``part_lse`` (``[B, H, S]``
    fp32) are the split scratch; their ``S`` is the number of KV splits."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    num_splits = part_lse.shape[2]
    if batch == 0:
        return
    block_d = _block_d(head_dim)
    block_n = DECODE_BLOCK_N if block_d <= 128 else DECODE_BLOCK_N // 2
    _decode_split_kernel[(batch, num_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, rows, seq_lens, part_acc, part_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    _decode_reduce_kernel[(batch, num_heads)](
        part_acc, part_lse, out,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


# -- extend and masked -------------------------------------------------------------------


@triton.jit
def _online_softmax_step(q, k, v, live, m_i, l_i, acc, qk_scale):
    """Fold one block of keys into the running (max, sum, output) of a block of
    queries. ``live`` ([BLOCK_M, BLOCK_N]) says which query reads which key; a query
    row with no live key so far keeps a -inf max and contributes nothing. ``tl.dot``
    runs in IEEE precision, so fp32 inputs are not rounded to TF32."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(live, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row still without a live key would compute -inf - -inf = NaN; shift it by 0.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(
    K, V, slot, n_ok, kv_head, stride_kn, stride_kh, stride_vn, stride_vh, d, d_ok, q,
):  # fmt: skip
    """The ``[BLOCK_N, BLOCK_D]`` K and V tiles of one KV head at the given KV slots,
    in ``q``'s dtype (for ``tl.dot``); keys past the live ones and lanes past head_dim
    read zeros."""
    tile_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(
        K + slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=tile_ok, other=0.0
    ).to(q.dtype)
    v = tl.load(
        V + slot[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=tile_ok, other=0.0
    ).to(q.dtype)
    return k, v


@triton.jit
def _extend_step(
    start, hi, q, q_pos, K, V, Table, row, kv_head, m_i, l_i, acc, qk_scale,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_table, d, d_ok,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold positions ``start .. start + BLOCK_N - 1`` (those below ``hi``) of one row
    into a block of queries at positions ``q_pos``, causally."""
    pos = start + tl.arange(0, BLOCK_N)
    n_ok = pos < hi
    slot = tl.load(Table + row * stride_table + pos, mask=n_ok, other=0).to(tl.int64)
    k, v = _load_kv_tile(
        K, V, slot, n_ok, kv_head, stride_kn, stride_kh, stride_vn, stride_vh, d, d_ok, q
    )
    live = n_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    return _online_softmax_step(q, k, v, live, m_i, l_i, acc, qk_scale)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, Table, Rows, QoStart, PrefixLens, ExtendLens,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (request, query head, block of new tokens): causal attention over the
    request's keys, prefix and new tokens alike, all read through its row."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = h // GROUP
    extend = tl.load(ExtendLens + b).to(tl.int64)
    prefix = tl.load(PrefixLens + b).to(tl.int64)
    qo = tl.load(QoStart + b).to(tl.int64)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = prefix + extend

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < extend
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + (qo + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # Keys past the block's last query are never seen; a block past this request's
    # new tokens (the grid is sized by the longest request) runs no iteration.
    hi = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    hi = hi * (m_block * BLOCK_M < extend).to(tl.int64)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WHILE_LOOPS:
        start = hi * 0
        while start < hi:
            m_i, l_i, acc = _extend_step(
                start, hi, q, q_pos, K, V, Table, row, kv_head, m_i, l_i, acc, qk_scale,
                stride_kn, stride_kh, stride_vn, stride_vh, stride_table, d, d_ok, BLOCK_N,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(0, hi, BLOCK_N):
            m_i, l_i, acc = _extend_step(
                start, hi, q, q_pos, K, V, Table, row, kv_head, m_i, l_i, acc, qk_scale,
                stride_kn, stride_kh, stride_vn, stride_vh, stride_table, d, d_ok, BLOCK_N,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + (qo + offs_m)[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    qo_start: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend: int,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Causal attention of packed new tokens (``q``: ``[T, H, D]``, request ``b``'s
    ``extend_lens[b]`` tokens from ``qo_start[b]``) over positions
    ``0 .. prefix_lens[b] + extend_lens[b] - 1`` of row ``rows[b]``, into ``out``."""
    batch = rows.numel()
    _, num_heads, head_dim = q.shape
    if batch == 0 or max_extend == 0:
        return
    block_m, block_n = _tile_shape(head_dim, max_extend, q.dtype)
    grid = (batch, num_heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, rows, qo_start, prefix_lens, extend_lens,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // k_buffer.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim),
        num_warps=4, num_stages=2,
    )  # fmt: skip


@triton.jit
def _masked_step(
    start, num_keys, b, offs_m, m_ok, q, K, V, KvSlots, Mask, kv_head, m_i, l_i, acc,
    qk_scale, stride_kn, stride_kh, stride_vn, stride_vh, stride_sb, stride_mb, stride_mq,
    d, d_ok, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold listed keys ``start .. start + BLOCK_N - 1`` of request ``b`` into a block
    of its queries, each reading the keys its mask row allows."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < num_keys
    slot = tl.load(KvSlots + b * stride_sb + n, mask=n_ok, other=0).to(tl.int64)
    k, v = _load_kv_tile(
        K, V, slot, n_ok, kv_head, stride_kn, stride_kh, stride_vn, stride_vh, d, d_ok, q
    )
    bits = tl.load(
        Mask + b * stride_mb + offs_m[:, None] * stride_mq + n[None, :],
        mask=m_ok[:, None] & n_ok[None, :],
        other=0,
    )
    return _online_softmax_step(q, k, v, bits != 0, m_i, l_i, acc, qk_scale)


@triton.jit
def _masked_kernel(
    Q, K, V, Out, KvSlots, Mask,
    qk_scale, num_queries, num_keys,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_sb, stride_mb, stride_mq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (request, query head, block of queries): attention over the request's
    listed KV slots, each query reading the keys its mask row allows."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = h // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_queries
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tokens = b * num_queries + offs_m
    q = tl.load(
        Q + tokens[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WHILE_LOOPS:
        start = num_keys * 0
        while start < num_keys:
            m_i, l_i, acc = _masked_step(
                start, num_keys, b, offs_m, m_ok, q, K, V, KvSlots, Mask, kv_head, m_i, l_i,
                acc, qk_scale, stride_kn, stride_kh, stride_vn, stride_vh, stride_sb,
                stride_mb, stride_mq, d, d_ok, BLOCK_N,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(0, num_keys, BLOCK_N):
            m_i, l_i, acc = _masked_step(
                start, num_keys, b, offs_m, m_ok, q, K, V, KvSlots, Mask, kv_head, m_i, l_i,
                acc, qk_scale, stride_kn, stride_kh, stride_vn, stride_vh, stride_sb,
                stride_mb, stride_mq, d, d_ok, BLOCK_N,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + tokens[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def masked_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_slots: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Attention of ``B * Q`` packed queries (``q``: ``[B * Q, H, D]``) over each
    request's keys ``kv_slots`` (``[B, K]`` int64, contiguous), query ``i`` of request
    ``b`` reading key ``j`` where ``mask[b, i, j]`` (``[B, Q, K]`` uint8, contiguous)
    is nonzero, into ``out``."""
    batch, num_queries, num_keys = mask.shape
    _, num_heads, head_dim = q.shape
    if batch == 0 or num_queries == 0:
        return
    block_m, block_n = _tile_shape(head_dim, num_queries, q.dtype)
    grid = (batch, num_heads, triton.cdiv(num_queries, block_m))
    _masked_kernel[grid](
        q, k_buffer, v_buffer, out, kv_slots, mask,
        scale * LOG2E, num_queries, num_keys,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        kv_slots.stride(0), mask.stride(0), mask.stride(1),
        GROUP=num_heads // k_buffer.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim),
        num_warps=4, num_stages=2,
    )  # fmt: skip
