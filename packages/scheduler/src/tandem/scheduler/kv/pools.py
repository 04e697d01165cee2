"""Memory pools: the request-to-token table (rows) and the paged KV pool (slots).

Both keep their free lists on the host, the truth the scheduler sizes batches with;
the device holds only the data (the table, the K/V buffers). Row 0 and page 0 are
padding: they belong to nobody, so padded batch entries can read and write them
harmlessly.
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass

import torch


class ReqToTokenPool:
    """``[num_rows + 1, max_context]`` int32 table: for each row, the KV slot of each
    token position of its request. Rows are handed out lowest first, so runs are
    reproducible."""

    def __init__(self, num_rows: int, max_context: int, device: torch.device | str) -> None:
        if num_rows < 1 or max_context < 1:
            raise ValueError(
                f"need num_rows >= 1 and max_context >= 1, got {num_rows}, {max_context}"
            )
        self.num_rows = num_rows
        self.max_context = max_context
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (num_rows + 1, max_context), dtype=torch.int32, device=self.device
        )
        self._free: list[int] = list(range(1, num_rows + 1))
        heapq.heapify(self._free)

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free row, or ``None`` when every row is taken."""
        return heapq.heappop(self._free) if self._free else None

    def free(self, row: int) -> None:
        if not 1 <= row <= self.num_rows:
            raise ValueError(f"row {row} is not a request row (1..{self.num_rows})")
        if row in self._free:
            raise RuntimeError(f"row {row} freed twice")
        heapq.heappush(self._free, row)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache: what one token costs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class PagedKVPool:
    """K and V buffers per layer, ``[num_pages * page_size, kv_heads, head_dim]``,
    handed out a page at a time. A request's token at position ``p`` lives in slot
    ``pages[p // page_size] * page_size + p % page_size``. Page 0 is padding."""

    def __init__(
        self, num_pages: int, page_size: int, layout: KVLayout, device: torch.device | str
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError(
                f"the KV pool needs at least 2 pages (one is padding), got {num_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self.device = torch.device(device)
        shape = (num_pages * page_size, layout.num_kv_heads, layout.head_dim)
        self._k = [
            torch.zeros(shape, dtype=layout.dtype, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self._v = [
            torch.zeros(shape, dtype=layout.dtype, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self._free: list[int] = list(range(1, num_pages))
        heapq.heapify(self._free)

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self._k[layer_id]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    @property
    def capacity_tokens(self) -> int:
        """Tokens that fit, padding page excluded."""
        return (self.num_pages - 1) * self.page_size

    @property
    def available_pages(self) -> int:
        return len(self._free)

    @property
    def available_tokens(self) -> int:
        return len(self._free) * self.page_size

    def free_page_list(self) -> list[int]:
        """The free pages, in no particular order (for checks)."""
        return list(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def alloc_pages(self, count: int) -> list[int] | None:
        """``count`` free pages, or ``None`` (and nothing taken) when too few are left."""
        if count > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(count)]

    def free_pages(self, pages: list[int]) -> None:
        for page in pages:
            if not 1 <= page < self.num_pages:
                raise ValueError(f"page {page} is not a KV page (1..{self.num_pages - 1})")
            heapq.heappush(self._free, page)
        if len(self._free) > self.num_pages - 1:
            raise RuntimeError("a KV page was freed twice")

    def slots(self, pages: list[int], start: int, end: int) -> list[int]:
        """KV slots of token positions ``[start, end)`` of a request holding ``pages``."""
        size = self.page_size
        return [pages[p // size] * size + p % size for p in range(start, end)]


def total_memory_bytes(device: torch.device) -> int:
    """Memory the KV budget is a fraction of: free device memory on accelerators,
    physical RAM on the CPU."""
    if device.type == "cpu":
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    free, _total = torch.get_device_module(device).mem_get_info(device)
    return int(free)
