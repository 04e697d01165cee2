"""Rotary position embeddings in the rotate-half ("neox") layout of the Llama family.

The cos/sin table is computed once, in float32, for every position the model supports,
and the forward only gathers rows of it by ``positions``: no per-step trigonometry, and
no dependence on how the batch is laid out (packed requests, decode, CUDA graphs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Self

import torch
from torch import nn

from tandem.scheduler.attention.casting import as_dtype

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def compute_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None
) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies on the CPU.

    Computed in float32 the way the checkpoints' reference implementation does, so the
    rotary angles match it bit for bit rather than being "more exact" than training was.
    """
    rope_type = "default" if scaling is None else str(scaling.get("rope_type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if scaling is not None and float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if rope_type == "llama3":
        assert scaling is not None
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's context extension: frequencies whose wavelength exceeds the original
    context are slowed by ``factor``, short wavelengths are kept, and the band between
    is blended linearly in ``original_context / wavelength``."""
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {', '.join(missing)}")
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(in_band, blended, slowed)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``) by per-token angles: ``cos`` and ``sin``
    as ``RotaryEmbedding`` returns them (``[T, 1, head_dim]``, see there).

    Pairs are (i, i + head_dim/2), the rotate-half layout these checkpoints were trained
    with: ``x * cos + roll(x, half) * sin`` with the first half of ``sin`` negated is
    ``(x1 c - x2 s, x2 c + x1 s)``, term for term. The math runs in float32 because bf16
    angles at long positions are too coarse.
    """
    x32 = as_dtype(x, torch.float32)
    swapped = torch.roll(x32, x32.shape[-1] // 2, dims=-1)
    return as_dtype((x32 * cos).addcmul_(swapped, sin), x.dtype)


class RotaryEmbedding(nn.Module):
    """The float32 ``[max_positions, head_dim]`` table (cos half, then sin half).

    The table is a non-persistent buffer so it follows the model across devices, but it
    is rebuilt rather than cast whenever the module is converted: ``.to(bfloat16)`` must
    not round it, and ``to_empty`` (materializing a meta-built model) must fill it.
    """

    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Mapping[str, Any] | None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        # Plain CPU tensor, not a buffer: it is an input to the table, never moved or cast.
        self._inv_freq = compute_inv_freq(head_dim, theta, scaling)
        self.register_buffer(
            "cos_sin_cache", self._table_on(torch.get_default_device()), persistent=False
        )

    def _table_on(self, device: torch.device) -> torch.Tensor:
        """The table, computed on the CPU (so identical on every device) and then moved."""
        if device.type == "meta":
            return torch.empty(self.max_positions, self.head_dim, device=device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        angles = positions[:, None] * self._inv_freq[None, :]
        return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.cos_sin_cache = self._table_on(self.cos_sin_cache.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for ``positions`` (``[T]``), each ``[T, 1, head_dim]`` float32
        in ``apply_rotary``'s full-width form: ``cos`` is ``(c, c)`` and ``sin`` is
        ``(-s, s)``. Built once per forward so every layer's rotation is three calls.

        Positions must be below ``max_positions``; the scheduler bounds contexts by it.
        """
        rows = self.cos_sin_cache.index_select(0, positions)
        cos, sin = rows.chunk(2, dim=-1)
        full_cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        signed_sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        return full_cos, signed_sin
