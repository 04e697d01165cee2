"""The draft head's KV cache: the target's slot numbering plus per-row scratch slots.

Draft KV at a committed position lives at the same slot as the target's (the scheduler
allocated it; ``req_to_token`` maps it), so one reservation serves both models. Tree
drafting also needs KV for nodes that may never be committed: those go to scratch
slots past the shared ones, ``scratch_per_row`` of them per row, keyed by the row like
the FutureMap (a row's scratch lives exactly as long as its request; no allocator).
"""

from __future__ import annotations

import torch

from tandem.scheduler.kv.pools import KVLayout


class DraftKVCache:
    """K and V per draft layer, ``[num_slots + (rows + 1) * scratch_per_row, heads, dim]``."""

    def __init__(
        self,
        num_slots: int,
        num_rows: int,
        scratch_per_row: int,
        layout: KVLayout,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.layout = layout
        self.num_slots = num_slots
        self.scratch_per_row = scratch_per_row
        total = num_slots + (num_rows + 1) * scratch_per_row
        shape = (total, layout.num_kv_heads, layout.head_dim)
        self._k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self._v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self._offsets = torch.arange(scratch_per_row, dtype=torch.int64, device=device)

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self._k[layer_id]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    def scratch_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, scratch_per_row]`` int64 scratch slots of each row."""
        base = self.num_slots + rows.to(torch.int64) * self.scratch_per_row
        return base.unsqueeze(1) + self._offsets
