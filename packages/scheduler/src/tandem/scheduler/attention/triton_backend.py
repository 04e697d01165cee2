"""The ``triton`` attention backend: paged attention in Triton kernels, on CUDA and
ROCm (and on a CPU under ``TRITON_INTERPRET=1``, for tests).

The kernels (``kernels.triton_attention``) read K/V in place through the request-to-token table,
so ``TritonAttention.plan`` builds almost nothing. A decode plan never touches host
lengths, which makes a decode forward capturable in a CUDA graph; extend plans
(prefill, mixed) size their grid from the host lists and are never captured. This
module imports Triton; the package imports it only when the backend is chosen.
See docs/guides/adding-an-attention-backend.md, "The two backends".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.scheduler.attention.base import (
    AttentionBackend,
    HeadShape,
    KVCacheView,
    masked_shape,
    write_kv,
)
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.kernels import triton_attention as kernels

DEFAULT_KV_SPLITS = 8


@dataclass
class _DecodePlan:
    out_cache_loc: torch.Tensor  # [B] KV slot of each request's new token
    rows: torch.Tensor  # [B] row of each request
    seq_lens: torch.Tensor  # [B] keys per request, its new token included
    part_acc: torch.Tensor  # [B, H, S, D] fp32 per-split outputs
    part_lse: torch.Tensor  # [B, H, S] fp32 per-split log2-sum-exp


@dataclass
class _ExtendPlan:
    out_cache_loc: torch.Tensor  # [T]
    rows: torch.Tensor  # [B]
    qo_start: torch.Tensor  # [B] first new token of each request in the [T] layout
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    max_extend: int  # longest run of new tokens: the grid's third dimension


@dataclass
class _MaskedPlan:
    out_cache_loc: torch.Tensor  # [B * Q]
    kv_slots: torch.Tensor  # [B, K] int64, contiguous
    mask: torch.Tensor  # [B, Q, K] uint8 view of the bool mask, contiguous


class TritonAttention(AttentionBackend):
    """Triton paged attention.

    A decode plan keeps references to the batch's device tensors (rows, sequence
    lengths, KV slots) and allocates the split scratch on the device, so replaying a
    captured decode forward with new values in the same input buffers attends over the
    new lengths. Extend plans size their grid from the host lists.
    """

    supports_cuda_graph = True

    def __init__(
        self,
        kv_cache: KVCacheView,
        req_to_token: torch.Tensor,
        heads: HeadShape,
        num_kv_splits: int = DEFAULT_KV_SPLITS,
    ) -> None:
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.heads = heads
        self.num_kv_splits = num_kv_splits
        self._plan: _DecodePlan | _ExtendPlan | _MaskedPlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        b = batch.batch_size
        device = batch.seq_lens.device
        if batch.mode is ForwardMode.DECODE or (
            b > 0 and max(batch.extend_lens_cpu) == 1 and min(batch.extend_lens_cpu) == 1
        ):
            h = self.heads
            # The scratch is the only allocation: on the device, so a capture that
            # includes plan owns it in the graph's pool like any other temporary.
            part_acc = torch.empty(
                (b, h.num_heads, self.num_kv_splits, h.head_dim),
                dtype=torch.float32,
                device=device,
            )
            part_lse = torch.empty(
                (b, h.num_heads, self.num_kv_splits), dtype=torch.float32, device=device
            )
            self._plan = _DecodePlan(
                batch.out_cache_loc, batch.rows, batch.seq_lens, part_acc, part_lse
            )
            return
        # Packed offsets on the device (an exclusive cumsum), not a host-to-device copy.
        qo_start = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        self._plan = _ExtendPlan(
            batch.out_cache_loc,
            batch.rows,
            qo_start,
            batch.prefix_lens,
            batch.extend_lens,
            max(batch.extend_lens_cpu, default=0),
        )

    def plan_masked(
        self, kv_slots: torch.Tensor, mask: torch.Tensor, out_cache_loc: torch.Tensor
    ) -> None:
        masked_shape(kv_slots, mask, out_cache_loc)
        # Triton loads bytes, not bools: a zero-copy uint8 view of the mask.
        bits = mask.contiguous().view(torch.uint8)
        self._plan = _MaskedPlan(out_cache_loc, kv_slots.long().contiguous(), bits)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("TritonAttention.forward called before plan()")
        k_buf, v_buf = write_kv(self.kv_cache, layer_id, plan.out_cache_loc, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        tokens, num_heads, head_dim = q.shape
        out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if isinstance(plan, _DecodePlan):
            if plan.part_acc.shape[1] != num_heads or plan.part_acc.shape[3] != head_dim:
                raise ValueError(
                    f"TritonAttention planned for {self.heads.num_heads} heads of "
                    f"{self.heads.head_dim}, got q of shape {tuple(q.shape)}"
                )
            kernels.decode_attention(
                q, k_buf, v_buf, self.req_to_token, plan.rows, plan.seq_lens, out,
                plan.part_acc, plan.part_lse, scale,
            )  # fmt: skip
        elif isinstance(plan, _ExtendPlan):
            kernels.extend_attention(
                q, k_buf, v_buf, self.req_to_token, plan.rows, plan.qo_start,
                plan.prefix_lens, plan.extend_lens, plan.max_extend, out, scale,
            )  # fmt: skip
        else:
            kernels.masked_attention(q, k_buf, v_buf, plan.kv_slots, plan.mask, out, scale)
        return out.view(tokens, num_heads * head_dim)
