"""Per-row penalty state on the device: what each request has generated so far.

Frequency and presence penalties (OpenAI semantics) need how often each token has been
*generated*; the repetition penalty (Hugging Face semantics) needs which tokens appear
in the prompt *or* the output. ``PenaltyState`` keeps both as dense tables indexed by
the request's row, like the FutureMap, so a batch gathers its rows with one
``index_select`` and the host never reads them. Nothing is allocated until the first
request with a penalty; then the size is fixed (``nbytes_for``). See
docs/guides/offline-engine.md, "Memory".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.scheduler.sampling.params import SamplingParams


@dataclass(frozen=True)
class PenaltyParams:
    """One batch's penalty coefficients, ``[B, 1]`` float32 device tensors, plus host
    flags so ``PenaltyState.apply`` skips the penalties nobody in the batch uses.
    Neutral values (frequency 0, presence 0, repetition 1) leave a row's logits
    bit-for-bit unchanged, so rows without penalties can share a penalised batch."""

    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    need_frequency_presence: bool
    need_repetition: bool

    @property
    def any(self) -> bool:
        return self.need_frequency_presence or self.need_repetition


class PenaltyState:
    """Generated-token counts and prompt-token masks per row, on the device.

    Every method except the constructor is device work: call it on the forward stream,
    in stream order with the forwards that read the same rows (a new owner's
    ``reset_row`` must come after the old owner's last ``record``).

    Args:
        num_rows: rows of the request pool; tables get ``num_rows + 1`` rows, row 0 is
            the padding row (padded batch entries write there harmlessly).
        vocab_size: logits width.
        device: where the tables live (the forward stream's device).
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        if num_rows < 1 or vocab_size < 1:
            raise ValueError(f"num_rows and vocab_size must be >= 1, got {num_rows}, {vocab_size}")
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None

    @staticmethod
    def nbytes_for(num_rows: int, vocab_size: int) -> int:
        """Bytes the tables take once allocated (int32 counts + bool prompt mask)."""
        return 5 * (num_rows + 1) * vocab_size

    @property
    def allocated(self) -> bool:
        return self._counts is not None

    @property
    def nbytes(self) -> int:
        """Bytes held now: 0 until a request with a penalty is admitted."""
        return self.nbytes_for(self.num_rows, self.vocab_size) if self.allocated else 0

    def reset_row(
        self,
        row: int,
        prompt_ids: torch.Tensor,
        params: SamplingParams | None = None,
        *,
        output_ids: torch.Tensor | None = None,
    ) -> None:
        """Start a request's penalty history at admission (allocating on first use).

        Calling it for every admitted request is fine: with ``params`` that use no
        penalty it does nothing (and allocates nothing), because neutral coefficients
        make whatever that request's row holds irrelevant.

        Args:
            row: the request's row (host int, 1..num_rows).
            prompt_ids: the prompt's token ids on the device (any integer dtype).
            params: the request's parameters; None means "it uses a penalty".
            output_ids: tokens already generated, for a request re-admitted after
                retraction, so its frequency and presence counts survive.
        """
        if not 1 <= row <= self.num_rows:
            raise ValueError(f"row must be in [1, {self.num_rows}], got {row}")
        if params is not None and not params.uses_penalties:
            return
        counts, prompt_mask = self._tables()
        counts[row].zero_()
        prompt_mask[row].zero_()
        prompt_mask[row].index_fill_(0, prompt_ids.to(torch.int64), True)
        if output_ids is not None and output_ids.numel() > 0:
            ones = torch.ones(output_ids.numel(), dtype=torch.int32, device=self.device)
            counts[row].index_add_(0, output_ids.reshape(-1).to(torch.int64), ones)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token (one per row, ``[B]``), after sampling.

        A no-op until some request used a penalty. Repeated rows (the padding row) are
        summed, not lost, because ``index_add_`` accumulates.
        """
        if self._counts is None or rows.numel() == 0:
            return
        flat = rows.to(torch.int64) * self.vocab_size + tokens.to(torch.int64)
        ones = torch.ones(flat.shape[0], dtype=torch.int32, device=flat.device)
        self._counts.view(-1).index_add_(0, flat, ones)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, params: PenaltyParams) -> None:
        """Penalise ``logits[B, V]`` in place for the batch's ``rows[B]``.

        Repetition first, then frequency and presence (vLLM's order), so the
        additive OpenAI penalties are not rescaled by the multiplicative one.
        """
        if not params.any:
            return
        if self._counts is None or self._prompt_mask is None:
            raise RuntimeError(
                "PenaltyState.apply before any reset_row: a request with a penalty was "
                "not registered at admission"
            )
        counts = self._counts.index_select(0, rows)
        appeared = counts > 0
        if params.need_repetition:
            seen = appeared | self._prompt_mask.index_select(0, rows)
            _repetition_penalty_(logits, seen, params.repetition)
        if params.need_frequency_presence:
            penalty = counts.to(logits.dtype) * params.frequency
            penalty += appeared.to(logits.dtype) * params.presence
            logits.sub_(penalty)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._prompt_mask is None:
            shape = (self.num_rows + 1, self.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._counts, self._prompt_mask


def _repetition_penalty_(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    # Dividing positive and multiplying negative logits always makes a seen token less
    # likely; a plain division would make negative logits *more* likely (HF's rule).
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, scaled, logits))
