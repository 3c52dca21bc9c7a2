"""EAGLE-2's dynamic draft tree: grow by the drafter's own confidence, keep the best nodes.

A drafter that gives a distribution per node (a draft model, later draft heads) grows a tree
level by level (Li et al. 2024, "EAGLE-2"): every node of the frontier proposes its `width`
most likely children, scored by the product of the drafter's probabilities along the path
(cumulative log-probability); the `width` best new nodes become the next frontier. After the
last level the `budget` best nodes of all levels form the draft. A child scores at most its
parent, so the best nodes always include their ancestors (ties go to the shallower node).

Worked example, width 2, budget 3: the root's children a (log q -0.1) and b (-2.3) are level 1;
expanding a gives aa (-0.1 - 0.2 = -0.3) and ab (-0.1 - 1.6 = -1.7), expanding b gives ba
(-2.3 - 0.1 = -2.4) and bb; the frontier is aa, ab. The best 3 of all: a, aa, ab.

The tree's nodes are deterministic (the verifier treats them as one-hot q: exact for any
choice of candidates); the scores only decide which candidates are worth a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.tree.token_tree import ROOT, TokenTree


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node of the growing tree: its token, parent candidate (ROOT for the root's
    children), depth and cumulative log-probability."""

    token: int
    parent: int
    depth: int
    score: float


class DynamicTree:
    """The candidates grown so far, and the frontier to expand next.

    Args:
        width: children per expanded node, and nodes per frontier.
        budget: nodes the final draft keeps.
    """

    def __init__(self, width: int, budget: int) -> None:
        self.width = width
        self.budget = budget
        self.candidates: list[Candidate] = []
        self.frontier: list[int] = []  # candidate indices expanded by the next level

    def expand(self, parents: list[int], logprobs: Tensor) -> None:
        """Add the `width` most likely children of each of `parents` (candidate indices, or
        [ROOT] for the root), whose log-probabilities over the vocabulary are `logprobs`
        ([len(parents), V]); the best `width` of them become the frontier."""
        top, tokens = logprobs.topk(self.width, dim=-1)  # [P, width] each
        first = len(self.candidates)
        for row, parent in enumerate(parents):
            base = 0.0 if parent == ROOT else self.candidates[parent].score
            depth = 1 if parent == ROOT else self.candidates[parent].depth + 1
            for lp, token in zip(top[row].tolist(), tokens[row].tolist(), strict=True):
                self.candidates.append(Candidate(token, parent, depth, base + lp))
        new = range(first, len(self.candidates))
        best = sorted(new, key=lambda i: -self.candidates[i].score)[: self.width]
        self.frontier = sorted(best)

    def path(self, node: int) -> list[int]:
        """Candidate indices from the root's child down to `node`."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.candidates[node].parent
        return out[::-1]

    def draft(self) -> tuple[list[int], TokenTree]:
        """The `budget` best candidates as (node tokens, tree shape), shallower nodes first."""
        cands = self.candidates
        ranked = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth))
        kept = sorted(ranked[: self.budget], key=lambda i: (cands[i].depth, i))
        node_of = {c: n for n, c in enumerate(kept)}
        parents = tuple(ROOT if cands[c].parent == ROOT else node_of[cands[c].parent] for c in kept)
        return [cands[c].token for c in kept], TokenTree(parents)


def frontier_pass(
    tree: DynamicTree, slots: dict[int, int], start: int, tree_start: int, device: torch.device
) -> tuple[Tensor, AttentionMetadata]:
    """The tokens ([1, F]) and the TREE metadata of one pass over the frontier of `tree`.

    The drafter's cache holds `start` slots: the committed entries (`tree_start` of them)
    followed by the tree's nodes fed by earlier levels (`slots`: candidate -> slot counted from
    `tree_start`; the frontier's slots are added). Each frontier node sees the committed
    entries, its fed ancestors and itself, at position `tree_start - 1 + depth`.
    """
    frontier = tree.frontier
    offset = start - tree_start  # tree slots cached by earlier levels
    mask = torch.zeros(1, len(frontier), offset + len(frontier), dtype=torch.bool)
    for j, node in enumerate(frontier):
        for ancestor in tree.path(node)[:-1]:
            mask[0, j, slots[ancestor]] = True
        slots[node] = offset + j
        mask[0, j, offset + j] = True
    cands = [tree.candidates[node] for node in frontier]
    tokens = torch.tensor([[c.token for c in cands]], device=device)  # [1, F]
    positions = torch.tensor([[tree_start - 1 + c.depth for c in cands]], device=device)
    meta = AttentionMetadata(
        AttentionMode.TREE,
        (start,),
        (len(frontier),),
        positions,
        mask.to(device),
        tree_starts=(tree_start,),
    )
    return tokens, meta


def log_confidence(logits: Tensor) -> Tensor:
    """The drafter's confidence used to grow trees: log softmax of the raw logits (temperature
    1, whatever the request samples with), [..., V] -> [..., V] float32."""
    return torch.log_softmax(logits.float(), dim=-1)


def reduced_log_confidence(logits: Tensor, draft_ids: Tensor, vocab_size: int) -> Tensor:
    """`log_confidence` of a head over a reduced draft vocabulary (logits [P, Vd], draft_ids
    [Vd] their target ids), spread over the target's `vocab_size` tokens: [P, V], -inf outside
    the draft vocabulary."""
    full = torch.full((len(logits), vocab_size), float("-inf"))
    full[:, draft_ids] = log_confidence(logits).cpu()
    return full
