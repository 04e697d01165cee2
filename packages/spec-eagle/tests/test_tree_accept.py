"""The draft tree and the acceptance walks, on hand-made trees and distributions."""

from __future__ import annotations

import torch

from tandem.spec_eagle.accept import accept_greedy, accept_sampled
from tandem.spec_eagle.tree import Candidates, DraftTree, ancestor_mask, select_tree


def _two_level_candidates() -> Candidates:
    # Root children 1, 2 (scores .6, .3); children of 1: 3, 4 (.6*.5, .6*.4); of 2: 5, 6.
    return Candidates(
        tokens=torch.tensor([[10, 20, 30, 40, 50, 60]]),
        scores=torch.tensor([[0.6, 0.3, 0.30, 0.24, 0.15, 0.06]]),
        parents=torch.tensor([[0, 0, 1, 1, 2, 2]]),
        depths=torch.tensor([[1, 1, 2, 2, 2, 2]]),
    )


def test_select_keeps_the_best_nodes_with_their_parents() -> None:
    tree = select_tree(torch.tensor([7]), _two_level_candidates(), num_nodes=5, max_depth=2)
    # Best four: .6 (1), .3 (2), .30 (3, a tie with 2 that the parent-first order keeps), .24.
    assert tree.tokens.tolist() == [[7, 10, 20, 30, 40]]
    assert tree.parents.tolist() == [[0, 0, 0, 1, 1]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2]]
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    assert tree.ancestors.int().tolist() == [expected]


def test_chain_mask_is_causal() -> None:
    parents = torch.tensor([[0, 0, 1, 2]])
    mask = ancestor_mask(parents, max_depth=3)
    assert torch.equal(mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def _tree() -> DraftTree:
    # root 0 -> 1 (tok 10), 2 (tok 20); 1 -> 3 (tok 30), 4 (tok 40); 3 -> 5 (tok 50)
    parents = torch.tensor([[0, 0, 0, 1, 1, 3]])
    return DraftTree(
        tokens=torch.tensor([[7, 10, 20, 30, 40, 50]]),
        parents=parents,
        depths=torch.tensor([[0, 1, 1, 2, 2, 3]]),
        ancestors=ancestor_mask(parents, 3),
    )


def test_greedy_walk_follows_the_target() -> None:
    tree = _tree()
    # Target argmax per node: at root 10 (accept node 1), at 1 -> 40 (node 4), at 4 -> 99.
    target = torch.tensor([[10, 40, 0, 0, 99, 0]])
    out = accept_greedy(tree, target, max_accept=4)
    assert out.num_accepted.tolist() == [2]
    assert out.path.tolist() == [[0, 1, 4, 4]]
    assert out.bonus.tolist() == [99]
    # Nothing matches at the root: only the bonus.
    out = accept_greedy(tree, torch.tensor([[11, 0, 0, 0, 0, 0]]), max_accept=4)
    assert out.num_accepted.tolist() == [0]
    assert out.bonus.tolist() == [11]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_rejection_sampling_preserves_the_target_distribution() -> None:
    """Each committed token is distributed as the target's p at its parent, whatever
    the drafts proposed (chi-square, 5 tokens, 40,000 draws, p < 0.001 critical)."""
    gen = torch.Generator().manual_seed(0)
    vocab, draws = 5, 40_000
    # Root children: tokens 1 and 3; node 1 has child token 2. p differs per node.
    parents = torch.tensor([[0, 0, 0, 1]]).expand(draws, 4)
    tree = DraftTree(
        tokens=torch.tensor([[0, 1, 3, 2]]).expand(draws, 4),
        parents=parents,
        depths=torch.tensor([[0, 1, 1, 2]]).expand(draws, 4),
        ancestors=ancestor_mask(parents, 2),
    )
    p_root = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])
    p_one = torch.tensor([0.25, 0.05, 0.4, 0.1, 0.2])
    node_probs = torch.stack([p_root, p_one, p_root, p_root]).double()
    probs = node_probs.unsqueeze(0).expand(draws, 4, vocab).contiguous()
    uniforms = torch.rand(draws, 2 * 2 + 1, dtype=torch.float64, generator=gen)
    out = accept_sampled(tree, probs, uniforms, max_accept=3, topk=2)
    tokens = tree.tokens.gather(1, out.path)
    first = torch.where(out.num_accepted > 0, tokens[:, 1], out.bonus)
    counts = torch.bincount(first, minlength=vocab).double()
    critical_df4 = 18.47
    assert _chi_square(counts, p_root.double()) < critical_df4
    # Given that token 1 was committed first, the next token follows p at node 1.
    after_one = out.num_accepted >= 1
    after_one &= tokens[:, 1] == 1
    second = torch.where(
        out.num_accepted[after_one] > 1, tokens[after_one, 2], out.bonus[after_one]
    )
    counts = torch.bincount(second, minlength=vocab).double()
    assert _chi_square(counts, p_one.double()) < critical_df4
    # The test can fail: committing drafts greedily would skew the first token to 1.
    assert (
        _chi_square(torch.bincount(tokens[:, 1], minlength=vocab).double(), p_root.double()) > 100
    )
