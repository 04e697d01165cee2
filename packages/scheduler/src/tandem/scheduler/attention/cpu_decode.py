"""Decode attention on the CPU: one query per request, the query heads that share a KV
head attended as one group, by tandem's decode kernel (``kernels/cpu_decode.cpp``), by
two matrix products (bfloat16 without the kernel) or by SDPA. ``attention.torch_backend``
calls in here for a CPU decode step; see docs/guides/adding-an-attention-backend.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.scheduler.kernels import cpu_build


def whole_stage(dtype: torch.dtype, kernel: bool) -> bool:
    """Whether a decode stage of K/V in ``dtype`` is attended whole, by two matrix
    products (``grouped_decode``), rather than cut to the longest sequence for SDPA
    or tandem's decode kernel (``kernel``: the backend's ``decode_kernel``).

    For bfloat16 without the kernel only. SDPA's CPU kernel is slow there, and the
    products are fast only on a contiguous operand: on a cut stage (a ``[:, :, :L]``
    slice of ``[B, Hkv, capacity, D]``) the matmul copies the keys first. In bfloat16 the
    whole stage is never slower and is faster on large batches; float32 gained little on
    large batches and lost on small ones, so it takes tandem's decode kernel
    (``kernel_fits``), or SDPA on the cut stage without it (measurements:
    docs/benchmarks.md, Measurements behind the code). The kernel reads each request's
    keys only, so bfloat16 with the kernel (AVX512-BF16's, or the float32 one over
    widened operands) cuts too."""
    return dtype == torch.bfloat16 and not kernel


def kernel_fits(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``torch.ops.tandem.decode_attention`` takes this step: float32, or
    bfloat16 with heads of a multiple of 32 elements (at most 256) and at most 8 query
    heads per KV head (``bf16_kernel_fits``); K and V laid out alike (the stage, or the
    gathered pages seen as ``[B, Hkv, L, D]``), each head's elements contiguous. It
    takes bfloat16 only where the build has AVX512-BF16 (``cpu_build.bf16_kernels``);
    elsewhere ``grouped_decode`` hands it the operands widened to float32."""
    dtype = keys.dtype
    if dtype == torch.bfloat16:
        fits = bf16_kernel_fits(q.shape[1], keys.shape[1], keys.shape[-1])
    else:
        fits = dtype == torch.float32
    return (
        fits
        and q.dtype == dtype == values.dtype
        and keys.stride(-1) == 1
        and keys.stride() == values.stride()
    )


def bf16_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the decode kernel's bfloat16 path takes heads of this shape."""
    return head_dim % 32 == 0 and head_dim <= 256 and num_heads // num_kv_heads <= 8


def grouped_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    kernel: bool,
) -> torch.Tensor:
    """Decode attention (one query per request) as SDPA over KV heads, with the ``G``
    query heads that share a KV head as ``G`` query rows: ``[B, Hkv, G, D]`` queries
    against ``[B, Hkv, L, D]`` keys. Same arithmetic as the ``[B, H, 1, D]`` GQA call,
    but SDPA's CPU kernel tiles the query rows, so one pass over a KV head's keys now
    serves its whole group instead of one head; a single-row tile leaves its products
    as matrix-vector work. The decode mask (``k < seq_len``) is the same for every
    query of a request, so it broadcasts over the rows.

    Grouping the heads is faster than the ``[B, H, 1, D]`` call at every shape tried,
    so there is no shape criterion. Two ``bmm`` over block-diagonal queries (each
    head's query in its KV head's ``D``-wide block of a zero ``[H, Hkv * D]`` matrix)
    was never faster at those shapes and wastes a factor ``Hkv`` of arithmetic
    (measurements: docs/benchmarks.md, Measurements behind the code). The grouped
    layout is measured on the CPU only; CUDA keeps the general path. tandem's decode
    kernel takes the step when ``kernel`` (``kernel_fits``); without it, bfloat16 K/V
    take two matrix products instead of SDPA (``whole_stage``). Returns ``[B, H * D]``."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    bf16_path = cpu_build.bf16_kernels() and kernel_fits(q, keys, values)
    if kernel and keys.dtype == torch.bfloat16 and not bf16_path:
        # No bfloat16 kernel in this build (no AVX512-BF16), or heads its bfloat16 path
        # does not take: the float32 kernel over the operands widened (exactly), its
        # output rounded once: much faster than the two bfloat16 products (measurements:
        # docs/benchmarks.md, Measurements behind the code).
        wide = (x.float() for x in (q, keys, values, mask))
        out = torch.ops.tandem.decode_attention(*wide, scale)
        return out.to(q.dtype)
    if kernel and kernel_fits(q, keys, values):
        out: torch.Tensor = torch.ops.tandem.decode_attention(q, keys, values, mask, scale)
        return out
    queries = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if keys.dtype == torch.bfloat16:
        # Scores and softmax in float32; on a whole stage the keys past a request hold
        # zeros (see DecodeStage), so their weight is exactly zero.
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float()
        weights = torch.softmax(scores.mul_(scale).add_(mask), dim=-1)
        out = torch.matmul(weights.to(values.dtype), values)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, num_heads * head_dim)
