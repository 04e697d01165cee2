"""Walking the verified tree: which drafted tokens the target accepts, and the bonus.

Both walks start at the root and descend one depth per round, at most
``max_accept - 1`` rounds, with fixed shapes and no host reads. ``accept_greedy``
accepts the child that is the target's argmax, so greedy rows commit exactly what
greedy decoding without speculation produces; ``accept_sampled`` uses rejection
sampling against the target distribution, so each committed token is distributed
exactly as without speculation. See docs/guides/speculative-decoding.md, "Sampling".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.scheduler.sampling.sampler import inverse_cdf
from tandem.spec_eagle.tree import DraftTree


@dataclass
class Accepted:
    """The walk's result.

    Attributes:
        path: ``[B, max_accept]`` node at each depth of the accepted path (column 0
            the root); past the accepted length it repeats the last accepted node.
        num_accepted: ``[B]`` accepted draft tokens (0..max_accept - 1).
        bonus: ``[B]`` the token the target picks after the accepted path.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor


def _children(tree: DraftTree, cur: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` bool: the children of each row's current node."""
    n = tree.parents.shape[1]
    not_root = torch.arange(n, device=cur.device) > 0
    return (tree.parents == cur.unsqueeze(1)) & not_root


def _walk_start(
    b: int, max_accept: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every walk starts at the root, alive, nothing accepted, the path all root."""
    return (
        torch.zeros(b, dtype=torch.int64, device=device),
        torch.ones(b, dtype=torch.bool, device=device),
        torch.zeros(b, dtype=torch.int64, device=device),
        torch.zeros(b, max_accept, dtype=torch.int64, device=device),
    )


def accept_greedy(tree: DraftTree, target_ids: torch.Tensor, max_accept: int) -> Accepted:
    """``target_ids`` ``[B, N]``: the target's argmax at every node."""
    cur, alive, count, path = _walk_start(target_ids.shape[0], max_accept, target_ids.device)
    for depth in range(1, max_accept):
        want = target_ids.gather(1, cur.unsqueeze(1))
        match = _children(tree, cur) & (tree.tokens == want)
        found = match.any(dim=1) & alive
        cur = torch.where(found, match.to(torch.int32).argmax(dim=1), cur)
        count += found
        alive &= found
        path[:, depth] = cur
    return Accepted(path, count, target_ids.gather(1, cur.unsqueeze(1)).squeeze(1))


def accept_sampled(
    tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor, max_accept: int, topk: int
) -> Accepted:
    """``probs`` ``[B, N, V]``: the target distribution at every node; ``uniforms``
    ``[B, (max_accept - 1) * topk + 1]`` float64 in [0, 1) (one per sibling trial, the
    last for the bonus draw).

    EAGLE drafts deterministically, so a proposed child's draft distribution is a point
    mass: child ``x`` is accepted with probability ``r(x) / sum(r)``, where ``r`` starts
    as the node's ``p`` and loses each rejected sibling. When every child is rejected,
    or the node is a leaf, the bonus is drawn from ``r``."""
    b, device = probs.shape[0], probs.device
    cur, alive, count, path = _walk_start(b, max_accept, device)
    residual = probs[:, 0].clone()
    trial = 0
    for depth in range(1, max_accept):
        children = _children(tree, cur)
        rank = children.to(torch.int64).cumsum(dim=1)
        moved = torch.zeros(b, dtype=torch.bool, device=device)
        nxt = cur
        for sibling in range(1, topk + 1):
            this = children & (rank == sibling)
            tried = this.any(dim=1) & alive & ~moved
            node = this.to(torch.int32).argmax(dim=1)
            token = tree.tokens.gather(1, node.unsqueeze(1))
            mass = residual.gather(1, token).squeeze(1)
            total = residual.sum(dim=1)
            ok = tried & (uniforms[:, trial] * total < mass)
            trial += 1
            rejected = tried & ~ok
            residual.scatter_(1, token, torch.where(rejected, 0.0, mass).unsqueeze(1))
            nxt = torch.where(ok, node, nxt)
            moved |= ok
        cur = nxt
        # A row that moved verifies its new node's children against a fresh p.
        fresh = probs.gather(1, cur.view(b, 1, 1).expand(b, 1, probs.shape[2])).squeeze(1)
        residual = torch.where(moved.unsqueeze(1), fresh, residual)
        count += moved
        alive &= moved
        path[:, depth] = cur
    bonus = inverse_cdf(residual, uniforms[:, -1])
    return Accepted(path, count, bonus)
