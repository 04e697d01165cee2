"""The decode trace: a CPU decode step replayed as one TorchScript graph.

The CPU's counterpart of a CUDA graph: the model's forward (embedding to final norm) of
a decode step that continues its decode stage (``attention.torch_backend.StagedDecode``)
is recorded once with ``torch.jit.trace`` and replayed by the TorchScript interpreter,
without Python between its calls and without the GIL. Sizes stay symbolic, so one
recording serves every batch size and length; other steps run eagerly. Why the replay
returns its inputs, and why a recording at one size is exact at another:
docs/concepts/overlap-loop.md, "The CPU forward stream".
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from tandem.scheduler.attention.base import AttentionBackend
from tandem.scheduler.attention.torch_backend import StagedDecode, TorchAttention
from tandem.scheduler.forward_batch import ForwardBatch
from tandem.scheduler.models import CausalLM

log = logging.getLogger(__name__)


class _StagedAttention(AttentionBackend):
    """An attention backend planned with one ``StagedDecode`` (inside the trace)."""

    def __init__(self, staged: StagedDecode) -> None:
        self.staged = staged

    def plan(self, batch: ForwardBatch) -> None:
        raise RuntimeError("a traced decode step is planned by its StagedDecode")

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self.staged.attend(layer_id, q, k, v, scale)


class _StagedForward(nn.Module):
    """The module that is traced: the decoder over a ``StagedDecode`` given as tensors.
    It holds the model's own decoder, so the trace shares its parameters."""

    def __init__(self, model: CausalLM, kernel: bool) -> None:
        super().__init__()
        self.decoder = model.model
        self.num_layers = model.config.num_hidden_layers
        self.kernel = kernel  # the attention's decode_kernel

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The final-norm hidden states, followed by every input, unchanged: an input
        the interpreter dropped mid-replay would make torch take the GIL there.
        ``tensors`` are the ``StagedDecode``'s, then the model's oneDNN weights, which
        the layers read themselves: a trace cannot hold them as constants, so they
        enter as inputs (the tracer knows them by identity)."""
        staged = tensors[: StagedDecode.count(self.num_layers)]
        attention = _StagedAttention(
            StagedDecode.from_tensors(staged, self.num_layers, self.kernel)
        )
        hidden, _ = self.decoder(input_ids, positions, attention)
        return (hidden, input_ids, positions, *tensors)


class DecodeTrace:
    """Replays a CPU decode step that continues its decode stage through one trace of
    the model's forward. Used on the forward stream only (by ``cpu_step.CpuStep``)."""

    def __init__(self, model: CausalLM, attention: TorchAttention) -> None:
        self._module = _StagedForward(model, attention.decode_kernel)
        self._weights = model.packed_weights()
        self._attention = attention
        self._traced: torch.jit.ScriptModule | None = None
        self._failed = False  # recording failed: every step runs eagerly
        self.replays = 0
        """Steps run by the trace so far."""

    @property
    def traced(self) -> bool:
        """Whether the forward has been recorded (at the first step that could be)."""
        return self._traced is not None

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """``CausalLM.forward`` of the planned ``batch`` by the trace, when the step
        continues its decode stage; None otherwise (the caller runs it eagerly)."""
        staged = self._attention.staged_decode()
        if staged is None or self._failed:
            return None
        inputs = (batch.input_ids, batch.positions, *staged.tensors(), *self._weights)
        if self._traced is None:
            self._traced = self._record(inputs)
            if self._traced is None:
                return None
        hidden: torch.Tensor = self._traced(*inputs)[0]
        self.replays += 1
        return hidden

    def _record(self, inputs: tuple[torch.Tensor, ...]) -> torch.jit.ScriptModule | None:
        """The recorded forward, or None (and eager from then on) if this torch cannot
        record it."""
        with warnings.catch_warnings():
            # The tracer warns at each size-dependent Python branch (RMSNorm's); those
            # compute the same function either way. torch
            # 2.13 deprecates torch.jit.trace in favour of torch.compile, which needs
            # a C++ compiler at run time; until the trace is gone it is the way to run
            # a forward without Python on any CPU machine.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", r"`torch\.jit\.trace", DeprecationWarning)
            try:
                traced: torch.jit.ScriptModule = torch.jit.trace(
                    self._module, inputs, check_trace=False
                )
            except (AttributeError, RuntimeError) as exc:
                log.warning("decode trace off, CPU decode runs eagerly: %s", exc)
                self._failed = True
                return None
        return traced
