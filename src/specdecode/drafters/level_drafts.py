"""Drafts from per-level distributions: heads that give every draft position at once.

Medusa's heads and a parallel EAGLE-3 head give, in one pass, logits over the reduced draft
vocabulary for each level d (the token at distance d + 1 from the last committed one), none
of them conditioned on the drafted tokens before it. A chain takes level d's pick for d_(d+1);
a tree is EAGLE-2's dynamic tree (`drafters.dynamic_tree`) whose level d nodes take level d's
top tokens for every parent (the same children under each, since no level sees its prefix;
the cumulative scores pick which paths are worth a slot).

Each level's q is the head's distribution after the request's sampling parameters, zero
outside the draft vocabulary; d_(d+1) is drawn from it alone, so q is exactly the distribution
the token came from and verification (against the target's full distribution) stays exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.drafters.base import SeqView
from specdecode.drafters.dynamic_tree import DynamicTree, reduced_log_confidence
from specdecode.errors import UserError
from specdecode.sampling.argmax import argmax
from specdecode.sampling.probs import SamplingTensors, probs_from_logits, sample
from specdecode.tree.token_tree import ROOT
from specdecode.types import Draft


def check_levels(
    levels: int, num_speculative_tokens: int, tree_width: int, tree_depth: int | None, what: str
) -> None:
    """Refuse a chain longer, or a tree deeper, than the `levels` one pass gives (`what`: the
    drafter and its limit in words, e.g. "this parallel head drafts at most 4 levels a pass")."""
    depth = num_speculative_tokens if tree_width == 1 else tree_depth
    if depth is not None and depth > levels:
        name = "num_speculative_tokens" if tree_width == 1 else "tree_depth"
        raise UserError(
            f"{what}: {name} {depth} is too {'long for a chain' if tree_width == 1 else 'deep'}"
        )


def empty_draft(tree: bool, vocab_size: int) -> Draft:
    """A draft of no tokens (a chain's carries [0, vocab_size] probabilities)."""
    if tree:
        return Draft(torch.zeros(0, dtype=torch.long))
    return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, vocab_size))


def chain_from_levels(seq: SeqView, logits: Tensor, draft_ids: Tensor, vocab_size: int) -> Draft:
    """Level j's pick for d_(j+1) (logits [k, Vd] on any device; draft_ids [Vd] host target
    ids): argmax under greedy parameters, else a sample from q_j with the request's generator.
    Returns Draft(tokens [k] int64, probs [k, vocab_size]; None under greedy parameters: the
    tokens are deterministic, q one-hot)."""
    if seq.params.greedy:
        return Draft(draft_ids[argmax(logits).cpu()])
    st = SamplingTensors.from_params([seq.params], logits.device)
    q = probs_from_logits(logits[None], st)[0].cpu()  # [k, Vd]
    k = len(q)
    picks = torch.cat([sample(q[j : j + 1], [seq.generator]) for j in range(k)])
    probs = torch.zeros(k, vocab_size)  # [k, V]
    probs[:, draft_ids] = q
    return Draft(draft_ids[picks], probs)


def tree_from_levels(
    logits: Tensor, k: int, width: int, draft_ids: Tensor, vocab_size: int
) -> Draft:
    """A dynamic tree of at most k nodes, `width` children per expanded node, whose level d
    nodes take level d's top tokens (logits [D, Vd]: D levels). Returns Draft(tokens, tree)."""
    scores = reduced_log_confidence(logits, draft_ids, vocab_size)  # [D, V]
    tree = DynamicTree(width, k)
    tree.expand([ROOT], scores[:1])
    for level in range(1, len(logits)):
        frontier = tree.frontier
        tree.expand(frontier, scores[level : level + 1].expand(len(frontier), -1))
    tokens, shape = tree.draft()
    return Draft(torch.tensor(tokens, dtype=torch.long), tree=shape)
