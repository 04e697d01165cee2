"""The draft tree: candidates grown level by level, the best ``num_draft_tokens - 1``
kept, their parents, depths and the ancestor mask the verify attention uses.

Everything is fixed-shape device work (no host reads), so it runs on the forward
stream of the overlap loop. Node 0 is the root, the last committed token (the previous
bonus); ``select_tree`` keeps the candidates in drafting order, so every parent comes
before its children. See docs/guides/speculative-decoding.md, "How a step keeps the
overlap".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Candidates:
    """Every drafted candidate of a step, ``[B, C]`` each, numbered from 1."""

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor  # candidate number of the parent; 0 is the root
    depths: torch.Tensor


@dataclass
class DraftTree:
    """The verified tree: ``N = num_draft_tokens`` nodes per request.

    Attributes:
        tokens: ``[B, N]`` token of each node (node 0: the root token).
        parents: ``[B, N]`` parent node (the root is its own parent).
        depths: ``[B, N]`` depth below the root (0 for the root).
        ancestors: ``[B, N, N]`` bool, ``[b, i, j]`` true when node ``j`` is node ``i``
            or one of its ancestors: the verify attention's mask inside the tree.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor


def select_tree(root: torch.Tensor, cands: Candidates, num_nodes: int, max_depth: int) -> DraftTree:
    """Keep the ``num_nodes - 1`` best candidates under the root ``[B]``; no candidate
    lies deeper than ``max_depth``.

    Candidates are numbered from 1 in drafting order: the root's ``topk`` children,
    then each later level's ``topk * topk`` children of that level's beam. A child's
    score is its parent's times its draft probability, never above its parent's, and
    the stable descending sort ranks a parent before its children even on ties, so the
    kept set is closed under "parent of". Kept nodes are renumbered ``1..N-1`` in
    candidate order: every parent comes before its children (node ``i`` sits at depth
    ``<= i``)."""
    b, c = cands.scores.shape
    keep = num_nodes - 1
    if keep > c:
        raise ValueError(f"{num_nodes} draft tokens need {keep} candidates, only {c} drafted")
    order = torch.sort(cands.scores, dim=1, descending=True, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=1).values  # candidate order: parents first
    tokens = torch.cat([root.view(b, 1), cands.tokens.gather(1, chosen)], dim=1)
    depths = torch.cat(
        [torch.zeros(b, 1, dtype=torch.int64, device=root.device), cands.depths.gather(1, chosen)],
        dim=1,
    )
    # Candidate number -> node number (0 stays the root).
    node_of = torch.zeros(b, c + 1, dtype=torch.int64, device=root.device)
    numbers = torch.arange(1, num_nodes, device=root.device).expand(b, keep)
    node_of.scatter_(1, chosen + 1, numbers)
    parents = torch.cat(
        [
            torch.zeros(b, 1, dtype=torch.int64, device=root.device),
            node_of.gather(1, cands.parents.gather(1, chosen)),
        ],
        dim=1,
    )
    return DraftTree(tokens, parents, depths, ancestor_mask(parents, max_depth))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N, N]``: each node sees itself and its ancestors. Each round adds the
    parent's set, so ``max_depth`` rounds reach the root from any node."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    index = parents.unsqueeze(2).expand(b, n, n)
    for _ in range(max(1, max_depth)):
        mask = mask | mask.gather(1, index)
    return mask
