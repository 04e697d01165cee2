"""The decode stage: a running decode batch's K/V kept contiguous across steps.

On the CPU, gathering every key of every request from the paged cache, each layer and
each step, is a large share of a small model's decode step, though the batch usually
gains one key per request from one step to the next. ``DecodeStage`` keeps each
layer's keys and values as ``[B, Hkv, capacity, D]`` tensors and appends each step's
new K/V, so a step that continues the previous one gathers nothing; it is used only
while the whole stage stays under ``MAX_BYTES``.
See docs/guides/adding-an-attention-backend.md, "The two backends".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.scheduler.attention.casting import as_dtype

if TYPE_CHECKING:
    from tandem.scheduler.attention.base import KVCacheView
    from tandem.scheduler.kv.pools import KVLayout

MAX_BYTES = 1 << 30
"""Largest stage, every layer's keys and values together, in bytes. A continued stage
also lets the decode trace replay the step (no GIL for the forward), which matters as
much to a large model as the gather it saves, so the bound is on memory alone."""

HEADROOM = 128
"""Keys of room beyond the longest sequence when a stage starts (then rounded up to
64): a stage serves at least this many steps before the longest request outgrows it
and the next step gathers a new one."""

WHOLE_HEADROOM = 32
"""``HEADROOM`` of a stage attended whole (bfloat16, see ``torch_backend``): every step
reads all ``capacity`` keys, so room not yet used costs as much as keys in use, and
a new stage (one gather, every 32 to 95 steps) is the cheaper price (measurements:
docs/benchmarks.md, Measurements behind the code)."""


def capacity_for(max_seq_len: int, attended_whole: bool) -> int:
    """Keys per request of a stage that starts at ``max_seq_len``; ``attended_whole``:
    each step attends over the whole stage rather than its first keys."""
    headroom = WHOLE_HEADROOM if attended_whole else HEADROOM
    return -(-(max_seq_len + headroom) // 64) * 64


@dataclass
class DecodeStage:
    """One decode batch's staged K/V.

    Continuing a stage is safe because a running request's K/V never change: each slot
    is written once, when its token is computed, and freed only after the request
    leaves the batch. The paged cache is still written every step, so a new stage, the
    radix cache and every other reader see the same K/V.

    ``append`` is the flat index, in a ``[B * Hkv * capacity, D]`` view of a layer's
    stage, of each request's new key per KV head (request-major), or None on the
    step that starts the stage, which fills it from a gather instead.
    """

    rows: list[int]
    seq_lens: list[int]
    capacity: int
    append: torch.Tensor | None = None
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def continues(self, rows: list[int], seq_lens: list[int]) -> bool:
        """Whether a decode step over ``rows`` at ``seq_lens`` extends this stage: the
        stage's rows or some of them (the others left the batch), in the stage's order,
        each one token longer, within the capacity."""
        kept = self._kept(rows)
        if kept is None or not seq_lens or max(seq_lens) > self.capacity:
            return False
        return all(new == self.seq_lens[i] + 1 for i, new in zip(kept, seq_lens, strict=True))

    def advance(
        self, rows: list[int], seq_lens: list[int], num_kv_heads: int, device: torch.device
    ) -> None:
        """Move to the next step (one that ``continues`` the stage): drop the requests
        that left (one ``index_select`` per layer's keys and values, far less than the
        gather a new stage starts from); each request's new key lands at
        ``seq_len - 1``."""
        if rows != self.rows:
            kept = self._kept(rows)
            assert kept is not None, "advance follows continues"
            index = torch.tensor(kept, dtype=torch.int64).to(device, non_blocking=True)
            for store in (self.keys, self.values):
                for layer, staged in store.items():
                    store[layer] = staged.index_select(0, index)
            self.rows = list(rows)
        self.seq_lens = seq_lens
        heads = range(num_kv_heads)
        flat = [
            (i * num_kv_heads + h) * self.capacity + s - 1
            for i, s in enumerate(seq_lens)
            for h in heads
        ]
        self.append = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)

    def check(self, kv_cache: KVCacheView, req_to_token: torch.Tensor) -> None:
        """Debug invariant, on a step that continues the stage (after ``advance``):
        every key the stage holds for a request (positions below its ``seq_len - 1``;
        the step's own comes next) equals the paged cache's at the slot its row maps.
        Raises ``RuntimeError`` naming the row and position of the first difference.

        Layer 0's keys suffice: a layer-0 key is a function of its token and position
        alone, so equal keys at every position mean the same tokens, and with them
        the same K/V in every layer. That keeps the check at one small gather a step."""
        staged = [s - 1 for s in self.seq_lens]
        longest = max(staged, default=0)
        if longest <= 0 or 0 not in self.keys:
            return
        device = req_to_token.device
        rows = torch.tensor(self.rows, dtype=torch.int64).to(device)
        slots = req_to_token.index_select(0, rows)[:, :longest].long().reshape(-1)
        stage = self.keys[0]
        b, heads, _, dim = stage.shape
        paged = kv_cache.k_buffer(0).index_select(0, slots).view(b, longest, heads, dim)
        same = (stage[:, :, :longest].transpose(1, 2) == paged).flatten(2).all(-1)
        positions = torch.arange(longest, device=device).view(1, longest)
        held = positions < torch.tensor(staged, dtype=torch.int64).to(device).view(-1, 1)
        wrong = (held & ~same).nonzero()
        if wrong.numel():
            i, pos = (int(x) for x in wrong[0])
            raise RuntimeError(
                f"decode stage out of step with the paged cache: row {self.rows[i]} "
                f"(seq_len {self.seq_lens[i]}) holds another key than the cache at "
                f"position {pos}; the stage was continued by a step whose request on "
                "that row is not the one it was staged for"
            )

    def _kept(self, rows: list[int]) -> list[int] | None:
        """The position in the stage of each of ``rows``, or None unless ``rows`` are
        stage rows in the stage's order."""
        if rows == self.rows:
            return list(range(len(rows)))
        position = {row: i for i, row in enumerate(self.rows)}
        kept = [position.get(row, -1) for row in rows]
        if -1 in kept or any(a >= b for a, b in itertools.pairwise(kept)):
            return None
        return kept

    def start(
        self, layer_id: int, gathered: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill a layer's stage on the step that starts it, from its keys and values
        gathered from the paged cache (``[B, L, Hkv, D]`` each, L the longest sequence,
        the step's own K/V written already), and return the stage's keys and values,
        ``[B, Hkv, capacity, D]``, zero past L. The steps that continue the stage
        attend with ``StagedDecode``."""
        keys, values = (self._start(x) for x in gathered)
        self.keys[layer_id], self.values[layer_id] = keys, values
        return keys, values

    def layers(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Every layer's staged keys and values, indexed by layer id. The start step
        ran the forward over every layer of one model, whose ids are ``0..n-1``."""
        layers = range(len(self.keys))
        return tuple(self.keys[i] for i in layers), tuple(self.values[i] for i in layers)

    def _start(self, gathered: torch.Tensor) -> torch.Tensor:
        """A layer's stage from its gathered ``[B, L, Hkv, D]`` K or V. Keys past L are
        zeroed: a request shorter than the batch's longest reads them (masked, so with
        weight zero, which only a finite value keeps at zero)."""
        b, length, heads, dim = gathered.shape
        stage = gathered.new_empty((b, heads, self.capacity, dim))
        stage[:, :, :length].copy_(gathered.transpose(1, 2))
        stage[:, :, length:].zero_()
        return stage


def stage_fits(batch: int, capacity: int, layout: KVLayout) -> bool:
    """Whether a stage of ``batch`` requests, ``capacity`` keys each, over a cache of
    ``layout`` (every layer's keys and values) stays under ``MAX_BYTES``."""
    return batch * capacity * layout.bytes_per_token <= MAX_BYTES


def append_to_stage(stage: torch.Tensor, append: torch.Tensor, new: torch.Tensor) -> None:
    """Write a step's new keys or values (``[B, Hkv, D]``) into a layer's stage
    (``[B, Hkv, capacity, D]``) at the flat indices ``append`` (``DecodeStage.append``)."""
    rows = new.reshape(-1, new.shape[-1])
    stage.view(-1, stage.shape[-1]).index_copy_(0, append, as_dtype(rows, stage.dtype))
