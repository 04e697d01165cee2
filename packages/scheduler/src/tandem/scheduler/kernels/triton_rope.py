"""Rotary embedding as one Triton kernel per tensor, for CUDA and ROCm.

``apply_rotary`` spells the rotation as six torch calls (cast, roll, two products, a
sum, the cast back); at batch 1 a decode step is bound by kernel launches, not bytes,
and those six launches for q and for k in every layer cost more than the arithmetic.
This kernel computes the same float32 formula, ``x * cos + roll(x, half) * sin`` with
``RotaryEmbedding``'s full-width ``cos`` and signed ``sin``, in one launch. Imported
only where Triton is used; the CPU keeps ``apply_rotary``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: every head of it, pairs (i, i + HEAD_DIM / 2).
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    in_dim = d < HEAD_DIM
    mask = (h < heads) & in_dim
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    row = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=in_dim, other=0.0)
    s = tl.load(sin_ptr + t * stride_ct + d, mask=in_dim, other=0.0)
    out = x * c + swapped * s
    dest = out_ptr + t * (heads * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary(x, cos, sin)`` in one launch: ``x`` is ``[T, heads, head_dim]``
    (last dimension contiguous), ``cos``/``sin`` ``[T, 1, head_dim]`` float32 as
    ``RotaryEmbedding`` returns them. Returns a new contiguous tensor of ``x``'s dtype."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos2, sin2 = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    if cos2.stride(-1) != 1 or sin2.stride() != cos2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    _rotary_kernel[(tokens,)](
        x, out, cos2, sin2, x.stride(0), x.stride(1), cos2.stride(0), heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out
