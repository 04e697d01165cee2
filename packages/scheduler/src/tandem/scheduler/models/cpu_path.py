"""The Llama block's CPU path: tandem's fused element-wise ops (``kernels/cpu_fused.cpp``),
the CPU's RMSNorm formulas and the feed-forward's row blocks. ``models.decoder`` is the
plain block and calls in here where a tensor is on the CPU; ``CausalLM.use_fused_cpu_ops``
turns the fused ops on (docs/guides/adding-a-model.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.scheduler.attention.casting import as_dtype

FUSED_NORM_MAX_ELEMENTS = 64 * 1024
"""Inputs up to this size are normed with ``F.rms_norm`` (one call), larger ones spelled out."""

MLP_BLOCK_BYTES = 8 << 20
"""The feed-forward of a long batch runs in row blocks whose gate/up output is at most
this large. Each block's output then stays in the cache while the activation and the
down projection read it, instead of streaming from memory: a long batch's feed-forward
is faster in both dtypes, the same over a wide range of block sizes, and a block as
large as the last-level cache loses most of the gain (measurements: docs/benchmarks.md,
Measurements behind the code)."""


def fused_fits(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether tandem's fused CPU ops take ``x``: a CPU tensor of float32 or bfloat16,
    ``others`` of its dtype."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and all(o.dtype == x.dtype for o in others)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    """RMSNorm of a CPU tensor: statistics in float32, the result cast back before the
    weight; with ``fused``, ``torch.ops.tandem.rms_norm`` in one pass where it fits."""
    if fused and fused_fits(x, weight):
        rows = x.reshape(-1, x.shape[-1])
        normed: torch.Tensor = torch.ops.tandem.rms_norm(rows, weight, eps)
        return normed.view(x.shape)
    x32 = as_dtype(x, torch.float32)  # casts only when they change something
    if x32.numel() <= FUSED_NORM_MAX_ELEMENTS:
        # One call for a decode-sized input (a small model's step is counted in calls);
        # the same formula, bit for bit.
        normed = F.rms_norm(x32, (x32.shape[-1],), None, eps)
    else:
        # Spelled out: F.rms_norm is several times slower on the CPU for prefill-sized inputs.
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * as_dtype(normed, x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` in one pass (``torch.ops.tandem.rotary``); ``fused_fits(x)``."""
    out: torch.Tensor = torch.ops.tandem.rotary(x, cos, sin)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (``torch.ops.tandem.silu_mul``); ``fused_fits``."""
    out: torch.Tensor = torch.ops.tandem.silu_mul(gate, up)
    return out


def mlp_block_rows(x: torch.Tensor, inner: int) -> int:
    """Rows per feed-forward block for the CPU tokens ``x`` (see ``MLP_BLOCK_BYTES``)."""
    return max(1, MLP_BLOCK_BYTES // (2 * inner * x.element_size()))
