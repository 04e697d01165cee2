"""What one forward needs, as device tensors plus the host-side truth they came from.

The scheduler builds a ``ForwardBatch`` from host state alone (no device reads); the
model runner resolves its input ids and runs the model; the attention backend plans
its metadata from it once and reuses that across layers.

Token order: the batch's new tokens are laid out request after request, each
request's ``extend_lens[i]`` tokens contiguous (a decode request contributes one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    """PREFILL (extend): new tokens after a cached prefix, several per request.
    DECODE: exactly one new token per request. MIXED: a prefill batch with decode
    requests riding along (one token each), prefill requests first. SPEC_DECODE: a
    speculative step (draft, verify, draft-extend) run by the speculative worker,
    which plans its own attention."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    SPEC_DECODE = "spec_decode"


@dataclass
class ForwardBatch:
    """One forward's inputs.

    Attributes:
        mode: see ``ForwardMode``.
        input_ids: ``[T]`` int64 token ids of the new tokens (on the device).
        positions: ``[T]`` int64 position of each new token in its sequence.
        rows: ``[B]`` int64 rows of the requests, in batch order.
        seq_lens: ``[B]`` int64 length of each sequence after this forward
            (``prefix_lens + extend_lens``).
        prefix_lens: ``[B]`` int64 tokens already in the KV cache before this forward.
        extend_lens: ``[B]`` int64 new tokens per request.
        out_cache_loc: ``[T]`` int64 KV slot each new token's K/V is written to.
        seq_lens_cpu: ``seq_lens`` as a host list: the truth the scheduler sized the
            batch with; backends plan from the host lists so planning never reads
            the device.
        extend_lens_cpu: ``extend_lens`` as a host list.
        rows_cpu: ``rows`` as a host list, when the caller has
            it (a backend may then recognise a batch of the same rows as the last).

    The host lists are the launched batch's own (``ScheduledBatch``), not copies:
    read them, never change them; a backend that keeps one past ``plan`` copies it.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    rows_cpu: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens_cpu)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index, in the ``[T]`` token layout, of each request's last new token (where
        its next-token logits come from)."""
        ends = torch.tensor(self.extend_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device, non_blocking=True)
