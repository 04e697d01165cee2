"""``as_dtype``: a dtype cast that costs nothing when there is nothing to cast.

Shared by the model and the attention backends, which sit side by side (neither
imports the other's modules for it).
"""

from __future__ import annotations

import torch


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, without a call when it already is: a no-op ``.to`` still
    costs a dispatch, and a small model's decode step is counted in calls."""
    return x if x.dtype == dtype else x.to(dtype)
