"""Relay fields: the per-row buffers of the FutureMap, declared by name, shape, dtype.

The two built-in fields (``output_tokens`` and ``new_seq_lens``) always exist. A
speculative worker declares what else its draft state needs between steps
(``topk_p``, ``topk_index``, ``hidden_states``, ...); the FutureMap allocates each
declared field lazily, on its first stash, as a ``[num_rows + 1, *shape]`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OUTPUT_TOKENS = "output_tokens"
NEW_SEQ_LENS = "new_seq_lens"
BUILTIN_FIELDS = (OUTPUT_TOKENS, NEW_SEQ_LENS)


@dataclass(frozen=True)
class RelayField:
    """One per-row buffer that carries a value from one forward to the next.

    Attributes:
        name: a Python identifier; also the keyword used in ``FutureMap.stash``.
        shape: the per-row shape (``()`` for a scalar per row).
        dtype: the element type the buffer holds; stashed values are cast to it.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"relay field name {self.name!r} is not a Python identifier")
        if self.name in BUILTIN_FIELDS:
            raise ValueError(f"relay field name {self.name!r} is reserved for the built-in field")
        if not isinstance(self.shape, tuple) or not all(
            isinstance(d, int) and d > 0 for d in self.shape
        ):
            raise ValueError(
                f"relay field {self.name!r}: shape must be a tuple of positive ints, "
                f"got {self.shape!r}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"relay field {self.name!r}: dtype must be a torch.dtype")

    def buffer_shape(self, num_rows: int) -> tuple[int, ...]:
        """The shape of the whole buffer: one entry per row plus padding row 0."""
        return (num_rows + 1, *self.shape)
