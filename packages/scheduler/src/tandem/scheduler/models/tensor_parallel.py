"""Tensor parallelism inside the model: which slice of each weight a rank holds, and
the two collectives its forward calls.

A rank holds a block of the attention heads (q/k/v by heads, ``o_proj`` by input), of
the MLP's intermediate units (gate/up by output, ``down_proj`` by input) and of the
vocabulary (embedding and head). ``o_proj``, ``down_proj`` and the embedding each end
with one all-reduce; the head with one all-gather, so every rank samples from the same
logits. With fewer KV heads than ranks, each rank keeps the one KV head its query heads
read. Parameters keep their checkpoint names, with the rank's slice as their shape
(``shard_rule``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.scheduler.models.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the tensor-parallel group, and its forward collectives.

    ``group`` is the process group the forward uses (on the forward stream only);
    ``None`` with one rank, where the collectives are the identity."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # -- the slices --------------------------------------------------------------------------
    def block(self, total: int) -> range:
        """This rank's block of ``total`` units split evenly."""
        n = total // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, config: ModelConfig) -> range:
        """The KV heads this rank keeps: its block, or with fewer KV heads than ranks
        the one its query heads read."""
        kv = config.num_key_value_heads
        if kv >= self.size:
            return self.block(kv)
        first_q = self.block(config.num_attention_heads).start
        group = config.num_attention_heads // kv
        head = first_q // group
        return range(head, head + 1)

    def vocab_rows(self, vocab: int) -> range:
        """This rank's vocabulary rows; the last block is padded past ``vocab``."""
        n = -(-vocab // self.size)
        return range(self.rank * n, (self.rank + 1) * n)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head and intermediate counts (the vocabulary stays
        whole: sampling sees all of it)."""
        if self.size == 1:
            return config
        return dataclasses.replace(
            config,
            num_attention_heads=config.num_attention_heads // self.size,
            num_key_value_heads=len(self.kv_heads(config)),
            intermediate_size=config.intermediate_size // self.size,
        )

    def shard_rule(self, name: str, config: ModelConfig) -> tuple[int, range] | str | None:
        """How the checkpoint tensor ``name`` maps onto this rank: ``(dim, indices)``
        for a slice, ``"first"`` for a bias of a reduced product (rank 0 adds it, the
        others hold zeros), ``None`` for a whole copy."""
        if self.size == 1:
            return None
        d = config.head_dim
        q = self.block(config.num_attention_heads)
        kv = self.kv_heads(config)
        inner = self.block(config.intermediate_size)
        module, _, kind = name.rpartition(".")
        module = module.rpartition(".")[2]
        heads = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        if module in heads:
            rows = heads[module]
            return 0, range(rows.start * d, rows.stop * d)
        if module in ("gate_proj", "up_proj"):
            return 0, inner
        if module == "o_proj":
            return (1, range(q.start * d, q.stop * d)) if kind == "weight" else "first"
        if module == "down_proj":
            return (1, inner) if kind == "weight" else "first"
        if module in ("embed_tokens", "lm_head"):
            return 0, self.vocab_rows(config.vocab_size)
        return None


SINGLE = TensorParallel()
"""One rank: the whole model, no collectives."""


def check_divisible(config: ModelConfig, tp_size: int) -> None:
    """Refuse a ``tp_size`` the model's shapes cannot be split by, with the numbers."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    inner = config.intermediate_size
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads={heads}")
    if kv >= tp_size and kv % tp_size:
        problems.append(f"num_key_value_heads={kv}")
    if kv < tp_size and tp_size % kv:
        problems.append(f"num_key_value_heads={kv} (fewer than the ranks, not a divisor)")
    if inner % tp_size:
        problems.append(f"intermediate_size={inner}")
    if problems:
        raise ValueError(f"tp_size={tp_size} does not divide the model's {', '.join(problems)}")


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding one block of the vocabulary: a token outside the block
    reads zeros, and the all-reduce brings each token its row from the rank that has
    it."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel) -> None:
        rows = tp.vocab_rows(vocab)
        super().__init__(len(rows), hidden, _weight=torch.empty(len(rows), hidden))
        self.tp = tp
        self.first = rows.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class VocabParallelHead(nn.Linear):
    """The output projection over one block of the vocabulary; ``forward`` returns the
    whole vocabulary's logits (gathered), so a caller such as a draft model that
    multiplies by the target's head needs to know nothing of the split."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel) -> None:
        super().__init__(hidden, len(tp.vocab_rows(vocab)), bias=False)
        self.tp = tp
        self.vocab = vocab

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This block's logits -> every block's, without the padding rows."""
        return self.tp.gather_last(local)[..., : self.vocab]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(F.linear(hidden, self.weight))
