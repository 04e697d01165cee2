"""Layers whose weights stay quantized in memory on the CPU (``--quantization``).

``QuantizedLinear`` and ``QuantizedEmbedding`` take the places of ``nn.Linear`` and
``nn.Embedding`` in the model tree: they hold a ``RowQuant`` (``quant_rows``) from load
until ``CausalLM.pack``, then panels (``quant_panels``) that ``torch.ops.tandem.linear_quant``
multiplies by. A tied head and embedding share one copy. ``pack_quantized`` gives the
fused projections (q/k/v, gate/up) one ``PackedLinear`` over them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.scheduler.models.packing import PackedLinear
from tandem.scheduler.models.quant_panels import QuantPanels, to_quant_panels

if TYPE_CHECKING:
    from tandem.scheduler.models.quant_rows import RowQuant

log = logging.getLogger(__name__)


class QuantizedLinear(nn.Module):
    """``y = x @ weight.T + bias`` over a quantized weight (see the module docstring)."""

    def __init__(
        self, in_features: int, out_features: int, bias: nn.Parameter | None, parts: int = 2
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.parts = parts  # x's 8-bit parts in the int8 products (``QuantPanels.parts``)
        self.quant: RowQuant | None = None  # set by ``load``, dropped by ``panels_once``
        self.panels: QuantPanels | None = None
        self.qtype = "?"  # the source type's name, once loaded

    def load(self, quant: RowQuant) -> None:
        """Take the weight in row form (the loader's)."""
        self.quant, self.panels, self.qtype = quant, None, quant.qtype

    def panels_once(self) -> QuantPanels:
        """The weight's panels, made from its row form on the first call."""
        if self.panels is None:
            if self.quant is None:
                raise RuntimeError("a QuantizedLinear was used before its weight was loaded")
            self.panels, self.quant = to_quant_panels(self.quant, parts=self.parts), None
        return self.panels

    def dequantized(self) -> torch.Tensor:
        """The weight in float32, ``[out_features, in_features]``: for readers of a
        weight (tests); the product never makes it. Not
        a ``weight`` attribute: tracing a module reads every attribute it has."""
        if self.panels is None and self.quant is not None:
            return self.quant.dequantize()
        return self.panels_once().dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Made only where the kernel is loaded (the loader checks), so no fallback here.
        return self.panels_once()(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over quantized rows, returned in ``dtype``; with a tied
    head, ``head`` is that head, whose panels hold the table."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.panels_once().rows(ids).to(self.dtype)


def quant_kernel() -> bool:
    """Whether ``torch.ops.tandem.linear_quant`` is registered in this process."""
    return hasattr(torch.ops.tandem, "linear_quant")


def pack_quantized(linears: Sequence[nn.Module]) -> PackedLinear | None:
    """One ``PackedLinear`` over ``linears`` (same input), each run of neighbours with one
    code layout as one panel set; None unless every layer is a ``QuantizedLinear`` and
    the kernel is loaded."""
    if not quant_kernel() or not all(isinstance(m, QuantizedLinear) for m in linears):
        return None
    layers = [m for m in linears if isinstance(m, QuantizedLinear)]
    biases = [m.bias for m in layers]
    if any(b is None for b in biases) != all(b is None for b in biases):
        raise ValueError("pack_quantized: some layers have a bias and some do not")
    runs: list[list[RowQuant]] = []
    for quant in (m.quant for m in layers):
        if quant is None:  # panels made already (a shared head): not stacked again
            return None
        last = runs[-1][-1] if runs else None
        if last is not None and (last.kind, last.block) == (quant.kind, quant.block):
            runs[-1].append(quant)
        else:
            runs.append([quant])
    parts = tuple(
        to_quant_panels(run[0] if len(run) == 1 else run[0].cat(run), parts=layers[0].parts)
        for run in runs
    )
    for m in layers:
        m.quant = None  # the stacked panels replace them
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    sizes = tuple(m.out_features for m in layers)
    # ``weight`` is an empty stand-in: the products read ``quant``.
    return PackedLinear(torch.empty(0, layers[0].in_features), bias, sizes, quant=parts)


def replace_with_quantized(
    model: nn.Module, names: Iterable[str], dtype: torch.dtype, tied: bool, parts: int = 2
) -> dict[str, QuantizedLinear]:
    """Swap the layers whose weights ``names`` (the model's names) stay quantized for
    ``QuantizedLinear``/``QuantizedEmbedding`` (on a model built on the meta device,
    before its storage is allocated); ``tied``: the head shares the embedding's table;
    ``parts``: ``QuantPanels.parts``. Returns the new layers by weight name, for the
    loader to fill."""
    layers: dict[str, QuantizedLinear] = {}
    for name in sorted(names):
        parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            table = QuantizedLinear(old.embedding_dim, old.num_embeddings, None, parts)
            setattr(parent, attr, QuantizedEmbedding(table, dtype))
            if tied:
                model.lm_head = table
            layers[name] = table
        else:
            layers[name] = QuantizedLinear(old.in_features, old.out_features, old.bias, parts)
            setattr(parent, attr, layers[name])
    return layers


@torch.no_grad()
def quantize_layers_int8(model: nn.Module, parts: int = 2, *, every_linear: bool = False) -> int:
    """Weight-only int8 (``quant_rows.quantize_int8``: a scale per 32 inputs of a row) for
    every ``nn.Linear`` of the decoder layers, made from their loaded float weights, each
    float weight freed as its codes are made; the embedding and head keep their dtype,
    as SGLang's and vLLM's weight-only schemes leave them (``every_linear``: every
    ``nn.Linear`` of ``model``, as a draft head wants). A layer whose inputs 4 does not
    divide keeps its float weight, with a warning: the kernel reads 8-bit codes in
    fours. Returns the layers converted."""
    from tandem.scheduler.models.quant_rows import quantize_int8

    converted = 0
    for name, old in list(model.named_modules()):
        if not isinstance(old, nn.Linear) or not (every_linear or ".layers." in f".{name}"):
            continue
        if old.in_features % 4:
            log.warning(
                "int8: %s keeps its float weight: its %d inputs are not a multiple of 4",
                name, old.in_features,
            )  # fmt: skip
            continue
        parent_name, _, attr = name.rpartition(".")
        layer = QuantizedLinear(old.in_features, old.out_features, old.bias, parts)
        layer.load(quantize_int8(old.weight))
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
        converted += 1
    return converted
