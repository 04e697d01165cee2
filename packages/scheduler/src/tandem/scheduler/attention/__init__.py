"""Attention backends behind one interface (``AttentionBackend``): ``torch`` on any
device (the CPU default) and ``flashinfer`` on CUDA, imported lazily so a CPU machine
never imports FlashInfer."""

from __future__ import annotations

import torch

from tandem.scheduler.attention.base import AttentionBackend, HeadShape, KVCacheView

__all__ = ["BACKENDS", "AttentionBackend", "HeadShape", "KVCacheView", "create_attention_backend"]

BACKENDS = ("torch", "flashinfer")


def default_backend(device: torch.device) -> str:
    """``torch`` everywhere for now; the GPU issue makes ``flashinfer`` the CUDA
    default once it is proven on a GPU."""
    return "torch"


def create_attention_backend(
    name: str,
    kv_cache: KVCacheView,
    req_to_token: torch.Tensor,
    device: torch.device,
    heads: HeadShape,
) -> AttentionBackend:
    """Build the backend called ``name``; an unknown name or a device the backend does
    not support is a ``ValueError`` naming both."""
    if name == "torch":
        from tandem.scheduler.attention.torch_backend import TorchAttention

        return TorchAttention(kv_cache, req_to_token)
    if name == "flashinfer":
        if device.type != "cuda" or torch.version.hip is not None:
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {device}")
        from tandem.scheduler.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(kv_cache, req_to_token, device, heads)
    raise ValueError(f"unknown attention_backend {name!r}; choose one of {', '.join(BACKENDS)}")
