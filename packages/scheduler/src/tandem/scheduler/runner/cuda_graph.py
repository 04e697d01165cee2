"""CUDA graphs of the decode forward, one per captured batch size.

A decode step of a small batch is hundreds of kernel launches whose host cost exceeds
the kernels' own time; replaying a captured graph turns them into one launch. A batch
of ``n`` requests replays the graph of the smallest captured size ``bs >= n``, padded
with entries that touch only the padding row and page. Only attention backends whose
decode ``plan`` reads device tensors alone (``AttentionBackend.supports_cuda_graph``)
can be captured; speculative steps are not (their shapes are planned per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.scheduler.attention import AttentionBackend
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode
from tandem.scheduler.models import CausalLM

# Positions, rows, sequence lengths, KV slots: the int64 block the host sends per step.
_POSITIONS, _ROWS, _SEQ_LENS, _SLOTS = range(4)
# What a padded entry reads and writes: position 0 of row 0, i.e. KV slot 0 (padding).
_PAD = (0, 0, 1, 0)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture up to ``max_bs``: every size to 8, then steps of 8 to 64,
    of 16 to 256, of 32 beyond: padding wastes at most 1/8 of a step, and the number of
    graphs (capture time, memory) stays small."""
    sizes = [1, 2, 4, 8]
    step_of = ((64, 8), (256, 16))
    size = 8
    while size < max_bs:
        size += next((step for limit, step in step_of if size < limit), 32)
        sizes.append(size)
    return sorted({min(s, max_bs) for s in sizes if s <= max_bs} | {max_bs})


@dataclass
class _Inputs:
    """The static inputs of one captured size."""

    ids: torch.Tensor  # [bs] int64 input ids, resolved into on the forward stream
    block: torch.Tensor  # [4, bs] int64 positions / rows / seq_lens / KV slots
    ones: torch.Tensor  # [bs] int64 extend lengths: one new token each, never written


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: _Inputs
    logits: torch.Tensor  # [bs, vocab] float32 output, overwritten by each replay


class DecodeGraphRunner:
    """Captures and replays decode forwards.

    The ``bs - n`` padded entries of a replay use row 0 (the request pool's padding
    row, whose first KV slot is in the padding page), sequence length 1, position 0 and
    KV slot 0, so they read and write only padding and their logits are dropped. Each
    captured size owns its static inputs: one ``[4, bs]`` int64 block (positions, rows,
    sequence lengths, KV slots) that the host fills, padding included, and sends with a
    single copy from pinned memory, plus the ``[bs]`` input ids that the FutureMap
    resolves into on the forward stream.
    """

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        device: torch.device,
        max_bs: int,
    ) -> None:
        if not attention.supports_cuda_graph:
            raise ValueError(
                f"the {type(attention).__name__} attention backend cannot be captured in "
                "a CUDA graph; use attention_backend='triton' or disable_cuda_graph=True"
            )
        self.model = model
        self.attention = attention
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self._graphs: dict[int, _Graph] = {}

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch_size: int) -> int | None:
        """The captured size a batch of ``batch_size`` replays, or ``None``."""
        return next((bs for bs in self.sizes if bs >= batch_size), None)

    # -- capture ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one shared memory pool (a smaller
        graph's temporaries fit in what the larger one left). Run before the loop
        starts, while the device has nothing else queued."""
        module = torch.get_device_module(self.device)
        pool = module.graph_pool_handle()
        stream = module.Stream(device=self.device)
        for bs in reversed(self.sizes):
            static = self._static_inputs(bs)
            with module.stream(stream):
                self._forward(static)  # compiles kernels and sizes workspaces, uncaptured
            stream.synchronize()
            graph = module.CUDAGraph()
            with module.graph(graph, pool=pool, stream=stream):
                logits = self._forward(static)
            self._graphs[bs] = _Graph(graph, static, logits)
        stream.synchronize()

    def _static_inputs(self, bs: int) -> _Inputs:
        block = torch.tensor([[v] * bs for v in _PAD], dtype=torch.int64, device=self.device)
        ids = torch.zeros(bs, dtype=torch.int64, device=self.device)
        return _Inputs(ids, block, torch.ones(bs, dtype=torch.int64, device=self.device))

    def _forward(self, static: _Inputs) -> torch.Tensor:
        bs = static.ids.numel()
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=static.ids,
            positions=static.block[_POSITIONS],
            rows=static.block[_ROWS],
            seq_lens=static.block[_SEQ_LENS],
            # A decode token's position is its prefix length: a view, no kernel to replay.
            prefix_lens=static.block[_POSITIONS],
            extend_lens=static.ones,
            out_cache_loc=static.block[_SLOTS],
            # Host lists of the capture's own padding: a graph-capable backend's
            # decode plan reads the device tensors only.
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
        )
        self.attention.plan(batch)
        hidden, _ = self.model.forward_capture(batch.input_ids, batch.positions, self.attention, ())
        return self.model.compute_logits(hidden)

    # -- replay (on the forward stream) ---------------------------------------------------
    def replay(
        self,
        input_ids: torch.Tensor,
        positions: Sequence[int],
        rows: Sequence[int],
        seq_lens: Sequence[int],
        out_cache_loc: Sequence[int],
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode batch of ``n`` requests. The result is a
        view of the graph's output: read it (sample) before the next replay, in stream
        order. ``input_ids`` is the resolved ``[n]`` device tensor; the rest are host
        lists, sent padded in one copy."""
        n = len(rows)
        bs = self.padded_size(n)
        if bs is None:
            raise ValueError(f"no CUDA graph for a batch of {n} (largest: {self.max_bs})")
        g = self._graphs[bs]
        pad = bs - n
        host = [
            [*positions, *[_PAD[_POSITIONS]] * pad],
            [*rows, *[_PAD[_ROWS]] * pad],
            [*seq_lens, *[_PAD[_SEQ_LENS]] * pad],
            [*out_cache_loc, *[_PAD[_SLOTS]] * pad],
        ]
        block = torch.tensor(host, dtype=torch.int64, pin_memory=True)
        g.inputs.block.copy_(block, non_blocking=True)
        g.inputs.ids[:n].copy_(input_ids)
        g.graph.replay()
        return g.logits[:n]
