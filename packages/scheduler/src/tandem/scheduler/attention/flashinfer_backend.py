"""The ``flashinfer`` attention backend (CUDA only).

This module is imported only when ``attention_backend="flashinfer"`` is chosen, so a
CPU machine never imports FlashInfer. ``FlashInferAttention`` views the KV pool's
per-layer buffers as FlashInfer's NHD paged layout and gathers page ids on the device
from the request-to-token table, so planning reads lengths from the host only. Its
numerical checks against the torch backend are GPU-marked tests.
See docs/guides/adding-an-attention-backend.md, "The two backends".
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.scheduler.attention.base import AttentionBackend, HeadShape, KVCacheView
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    """Paged prefill (with prefixes) and decode through FlashInfer's batch wrappers."""

    def __init__(
        self,
        kv_cache: KVCacheView,
        req_to_token: torch.Tensor,
        device: torch.device,
        heads: HeadShape,
    ) -> None:
        import flashinfer  # lazy: CUDA machines only

        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.device = device
        self.heads = heads
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._wrapper: Any = None
        self._out_cache_loc: torch.Tensor | None = None

    def _page_table(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = self.kv_cache.page_size
        pages_per_req = [(n + size - 1) // size for n in batch.seq_lens_cpu]
        indptr = torch.tensor([0, *pages_per_req], dtype=torch.int32).cumsum(0).int()
        last_len = torch.tensor(
            [n - (p - 1) * size for n, p in zip(batch.seq_lens_cpu, pages_per_req, strict=True)],
            dtype=torch.int32,
        )
        flat_rows = torch.repeat_interleave(
            torch.arange(batch.batch_size), torch.tensor(pages_per_req, dtype=torch.int64)
        )
        flat_pos = (
            torch.cat([torch.arange(p) * size for p in pages_per_req])
            if pages_per_req
            else torch.empty(0, dtype=torch.int64)
        )
        rows = batch.rows[flat_rows.to(self.device)]
        slots = self.req_to_token[rows, flat_pos.to(self.device)]
        indices = (slots // size).int()
        return indptr.to(self.device), indices, last_len.to(self.device)

    def plan(self, batch: ForwardBatch) -> None:
        h = self.heads
        indptr, indices, last_len = self._page_table(batch)
        self._out_cache_loc = batch.out_cache_loc
        if batch.mode is ForwardMode.DECODE:
            self._decode.plan(
                indptr, indices, last_len, h.num_heads, h.num_kv_heads, h.head_dim,
                self.kv_cache.page_size, sm_scale=h.scale, q_data_type=h.dtype,
                kv_data_type=h.dtype,
            )  # fmt: skip
            self._wrapper = self._decode
            return
        qo_indptr = torch.tensor([0, *batch.extend_lens_cpu], dtype=torch.int32).cumsum(0).int()
        self._prefill.plan(
            qo_indptr.to(self.device), indptr, indices, last_len, h.num_heads, h.num_kv_heads,
            h.head_dim, self.kv_cache.page_size, causal=True, sm_scale=h.scale,
            q_data_type=h.dtype, kv_data_type=h.dtype,
        )  # fmt: skip
        self._wrapper = self._prefill

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self._wrapper is None or self._out_cache_loc is None:
            raise RuntimeError("FlashInferAttention.forward called before plan()")
        k_buf = self.kv_cache.k_buffer(layer_id)
        v_buf = self.kv_cache.v_buffer(layer_id)
        k_buf.index_copy_(0, self._out_cache_loc, k.to(k_buf.dtype))
        v_buf.index_copy_(0, self._out_cache_loc, v.to(v_buf.dtype))
        size = self.kv_cache.page_size
        paged = (
            k_buf.view(-1, size, *k_buf.shape[1:]),
            v_buf.view(-1, size, *v_buf.shape[1:]),
        )
        out = self._wrapper.run(q.contiguous(), paged)
        return out.reshape(q.shape[0], -1)
