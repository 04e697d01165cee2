"""The decode trace: a CPU decode step replayed as one TorchScript graph.

A small model's CPU decode step is counted in calls, not in arithmetic: about a
hundred torch calls per step, each paying several microseconds of Python and
dispatcher overhead whatever its size. And in the overlap loop the forward thread needs
the GIL between every two calls, so the scheduler's host work and the forward's glue
take turns instead of running side by side. The trace is the CPU's counterpart of a
CUDA graph: the model's decode forward recorded once with ``torch.jit.trace`` and
replayed by the TorchScript interpreter, which runs the whole layer stack without
Python and releases the GIL for the call, so the scheduler thread builds the next
batch meanwhile, in parallel.

What is traced: the model's forward (embedding to final norm) of a decode step that
continues its decode stage (``attention.torch_backend.StagedDecode``), the common step
of a steady CPU decode batch. Every input of such a step is a tensor, and the sizes the
forward reads from them (batch size, key length) stay symbolic in the trace, so one
trace, recorded at the first such step, serves every batch size and length. Other
steps (prefills, the step that starts a stage, speculative steps) run eagerly. The
runner still resolves the input ids from the FutureMap before the replay and samples
and stashes after it: the protocol's reads and writes stay explicit.

Why the traced forward returns its inputs. torch keeps a tensor's Python object alive
while C++ code holds references to the tensor, and lets it go when the count of those
references falls back to the Python object's own: at that moment torch takes the GIL
(PyObject preservation, ``c10::intrusive_ptr``). The replay's inputs are Python tensors,
and the interpreter drops each one after its last use, mid-graph, without the GIL: so
each input cost the replay one wait for the GIL (14 per step for the default model,
measured), and whenever the scheduler thread was running Python the forward stalled
until it stopped. The overlap loop then gained almost nothing on the CPU: the host's
work and the forward took turns. Returned as outputs, the inputs stay referenced until
the call has retaken the GIL on its way out, and the replay runs without it from end
to end.

A trace records one path through Python: branches taken on sizes (``RMSNorm``'s
small-input branch) or dtypes are fixed at the traced step. The model's branches
compute the same function, so a replay at another size is the eager step's arithmetic
(tested token for token against the eager engine). Recording runs the step once and the
replay runs it again; the step writes the same K/V to the same cache slots and stage
positions both times, so that is harmless.
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

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.decoder = model.model
        self.num_layers = model.config.num_hidden_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, *staged: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The final-norm hidden states, followed by every input, unchanged: returning
        the inputs keeps the replay from needing the GIL (see the module docstring)."""
        attention = _StagedAttention(StagedDecode.from_tensors(staged, self.num_layers))
        hidden, _ = self.decoder(input_ids, positions, attention)
        return (hidden, input_ids, positions, *staged)


class DecodeTrace:
    """Replays a CPU decode step that continues its decode stage through one trace of
    the model's forward (see the module docstring). Used on the forward stream only."""

    def __init__(self, model: CausalLM, attention: TorchAttention) -> None:
        self._module = _StagedForward(model)
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
        inputs = (batch.input_ids, batch.positions, *staged.tensors())
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
            # compute the same function either way (see the module docstring). torch
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
