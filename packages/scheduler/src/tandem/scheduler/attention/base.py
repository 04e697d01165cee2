"""The attention-backend interface: plan once per batch, then per layer write K/V and
attend.

Backends see the paged KV cache through ``KVCacheView`` (one K and one V buffer per
layer, indexed by KV slot) and the request-to-token table (row -> slots). They never
allocate KV themselves: the scheduler did that, and ``ForwardBatch.out_cache_loc``
says where each new token's K/V goes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.scheduler.attention.casting import as_dtype
from tandem.scheduler.forward_batch import ForwardBatch
from tandem.scheduler.kv.pools import KVLayout


@dataclass(frozen=True)
class HeadShape:
    """The attention heads of a model, for backends that plan with them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype


class KVCacheView(Protocol):
    """What an attention backend needs of the KV pool."""

    page_size: int
    layout: KVLayout

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` keys of one layer."""
        ...

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` values of one layer."""
        ...


class AttentionBackend(ABC):
    """One attention implementation (``torch``, ``flashinfer``, ...).

    Implementations are built with the paged KV pool's buffers (a ``KVCacheView``) and
    the ``[rows + 1, max_context]`` int32 request-to-token table of KV slots per row.
    """

    supports_cuda_graph: bool = False
    """Whether a decode forward can be captured in a CUDA graph and replayed with new
    values in the same input buffers: true of a backend whose decode ``plan`` reads
    only device tensors of the ``ForwardBatch`` (no host lengths, no host-to-device
    copies) and whose decode kernels' grid depends on the batch size alone."""

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Build this batch's metadata (index tensors, masks) once, from host-side
        lengths; every layer of the forward reuses it."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Write ``k``/``v`` (``[T, num_kv_heads, head_dim]``) into the cache at the
        batch's ``out_cache_loc``, then attend causally with ``q``
        (``[T, num_heads, head_dim]``) over each request's prefix plus its new tokens.
        Returns ``[T, num_heads * head_dim]``."""

    def plan_masked(
        self, kv_slots: torch.Tensor, mask: torch.Tensor, out_cache_loc: torch.Tensor
    ) -> None:
        """Plan a batch whose keys and mask are given explicitly (speculative
        decoding: draft trees and tree verification).

        Every one of the ``B`` requests has exactly ``Q`` new tokens, laid out request
        after request (``[B * Q]``). ``kv_slots`` (``[B, K]`` int64) names the KV slots
        each request's queries may read, ``mask`` (``[B, Q, K]`` bool, device data)
        which of them each query does read; each query must see at least one key (its
        own). The new tokens' K/V are written at ``out_cache_loc`` (``[B * Q]``) before
        attending, so a slot listed in ``kv_slots`` may be one written now.
        """
        raise NotImplementedError(
            f"the {type(self).__name__} attention backend has no custom-mask attention, "
            "which speculative decoding needs; use attention_backend='torch' or 'triton'"
        )


def write_kv(
    kv_cache: KVCacheView,
    layer_id: int,
    out_cache_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new tokens' K/V at their KV slots (cast to the cache's dtype) and
    return the layer's K and V buffers: the first half of every backend's ``forward``."""
    k_buf = kv_cache.k_buffer(layer_id)
    v_buf = kv_cache.v_buffer(layer_id)
    write_kv_buffers(k_buf, v_buf, out_cache_loc, k, v)
    return k_buf, v_buf


def write_kv_buffers(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out_cache_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """``write_kv`` into one layer's K and V buffers given as tensors (what a traced
    forward holds instead of a ``KVCacheView``)."""
    if native_store(k_buf, k, out_cache_loc):
        torch.ops.tandem.store_kv(k, v, k_buf, v_buf, out_cache_loc, None, None, None)
        return
    k_buf.index_copy_(0, out_cache_loc, as_dtype(k, k_buf.dtype))
    v_buf.index_copy_(0, out_cache_loc, as_dtype(v, v_buf.dtype))


def native_store(k_buf: torch.Tensor, k: torch.Tensor, out_cache_loc: torch.Tensor) -> bool:
    """Whether ``torch.ops.tandem.store_kv`` (``kernels/cpu_decode.cpp``, loaded with
    the CPU kernels) writes this layer's K/V: one pass over the new rows in place of an
    ``index_copy_`` per buffer, K and V already in the cache's dtype (measurements:
    docs/benchmarks.md, Measurements behind the code)."""
    return (
        k_buf.device.type == "cpu"
        and k.dtype == k_buf.dtype
        and out_cache_loc.dtype == torch.int64
        and hasattr(torch.ops.tandem, "store_kv")
    )


def masked_shape(
    kv_slots: torch.Tensor, mask: torch.Tensor, out_cache_loc: torch.Tensor
) -> tuple[int, int, int]:
    """``(B, Q, K)`` of a ``plan_masked`` call, after checking that its three inputs
    agree (a ``ValueError`` naming their shapes otherwise)."""
    b, q, k = mask.shape
    if tuple(kv_slots.shape) != (b, k) or out_cache_loc.numel() != b * q:
        raise ValueError(
            f"plan_masked: kv_slots {tuple(kv_slots.shape)}, mask {tuple(mask.shape)} "
            f"and out_cache_loc [{out_cache_loc.numel()}] disagree"
        )
    return b, q, k
