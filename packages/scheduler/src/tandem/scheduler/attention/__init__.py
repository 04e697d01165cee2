"""Attention backends behind one interface (``AttentionBackend``): ``torch`` on any
device (the CPU default), ``triton`` on CUDA and ROCm (the GPU default when Triton is
installed; on a CPU only under ``TRITON_INTERPRET=1``, for tests) and ``flashinfer``
on CUDA. Backends are imported lazily, so importing this package never imports Triton
or FlashInfer."""

from __future__ import annotations

import importlib.util

import torch

from tandem.futuremap import read_env
from tandem.scheduler.attention.base import AttentionBackend, HeadShape, KVCacheView

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "HeadShape",
    "KVCacheView",
    "create_attention_backend",
    "triton_available",
]

BACKENDS = ("torch", "triton", "flashinfer")


def triton_available() -> bool:
    """Whether Triton is installed; looked up, not imported (importing Triton costs
    time, and a CPU machine should never pay it)."""
    return importlib.util.find_spec("triton") is not None


def default_backend(device: torch.device) -> str:
    """``triton`` on a GPU (CUDA or ROCm; torch names both ``cuda``) when Triton is
    installed: it reads the paged cache in place and its decode can be captured in a
    CUDA graph. ``torch`` otherwise, and always on the CPU."""
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"


def create_attention_backend(
    name: str,
    kv_cache: KVCacheView,
    req_to_token: torch.Tensor,
    device: torch.device,
    heads: HeadShape,
    debug: bool = False,
    triton_interpret: bool | None = None,
    decode_kernel: bool = False,
) -> AttentionBackend:
    """Build the backend called ``name``; an unknown name, a device the backend does
    not support or a missing package is a ``ValueError`` naming it. ``debug`` turns on
    the backend's debug invariants (the ``torch`` backend's decode-stage check).
    ``triton_interpret``: Triton runs in its interpreter, which lets ``triton`` run on
    a CPU; ``None`` reads ``TRITON_INTERPRET`` (``read_env``). ``decode_kernel``: the
    ``torch`` backend attends float32 CPU decode steps with
    ``torch.ops.tandem.decode_attention`` (``kernels.cpu_build``, loaded already)."""
    if name == "torch":
        from tandem.scheduler.attention.torch_backend import TorchAttention

        return TorchAttention(
            kv_cache, req_to_token, check_stage=debug, decode_kernel=decode_kernel
        )
    if name == "triton":
        if triton_interpret is None:
            triton_interpret = read_env().triton_interpret
        if device.type != "cuda" and not (device.type == "cpu" and triton_interpret):
            raise ValueError(
                "attention_backend='triton' needs a CUDA or ROCm device (on a CPU it runs "
                f"only under TRITON_INTERPRET=1, for tests), got {device}"
            )
        if not triton_available():
            raise ValueError(
                "attention_backend='triton' needs the 'triton' package, which is not "
                "importable here"
            )
        from tandem.scheduler.attention.triton_backend import TritonAttention

        return TritonAttention(kv_cache, req_to_token, heads)
    if name == "flashinfer":
        if device.type != "cuda" or torch.version.hip is not None:
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {device}")
        if importlib.util.find_spec("flashinfer") is None:
            raise ValueError(
                "attention_backend='flashinfer' needs the 'flashinfer-python' package: "
                "pip install 'tandem-scheduler[cuda]'"
            )
        from tandem.scheduler.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(kv_cache, req_to_token, device, heads)
    raise ValueError(f"unknown attention_backend {name!r}; choose one of {', '.join(BACKENDS)}")
