"""Tree verification: exact multi-candidate speculative sampling over a token tree.

The target's distribution is `p` (one per node, from one pass over the tree), the drafter's `q`.
A walk starts at the root (the last committed token) with the residual r = p_root and tries the
current node's children c_1, c_2, ... in order:

    accept c_i (token x_i) with probability min(1, r(x_i) / q_i(x_i))
        -> move to c_i: r = p_{c_i}; go on with c_i's children
    reject -> r = norm(max(r - q_i, 0)); try c_{i+1}
    no child left to try -> emit one token drawn from r (recovered after a rejection, bonus at
        a node without children) and stop.

q_i is the distribution child i was drawn from given everything drawn before it (`Draft.probs`
row of the node): q itself for children drawn i.i.d. from q (SpecInfer's multi-step speculative
sampling, Miao et al. 2024); q without the earlier siblings, renormalised, for children drawn
without replacement; one-hot for deterministic children (top-k, n-gram continuations), where
acceptance has probability r(x_i) and a rejection removes x_i's mass from r: sampling p without
replacement over the candidates. The general form is recursive rejection sampling (Jeon et al.
2024, "Recursive Speculative Decoding"). It is exact by induction over the tries at one node:
if x_i ~ q_i given the walk so far, then "accept x_i, else draw from norm(max(r - q_i, 0))" emits
a token distributed as r (min(r, q_i) + max(r - q_i, 0) = r), so the node's first token is
distributed as p; an accepted child then starts the same problem one level deeper with p_child.
Greedy p is one-hot: the walk follows the child equal to argmax p and emits argmax p where none
does. Greedy batches take a loop-free path on token ids (`verify_tree_greedy`) with the same
result when siblings carry distinct tokens (with repeated siblings it may keep a longer,
equally exact path).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.sampling.rejection import PAD, draw_uniforms, sample_inverse_cdf
from specdecode.tree.token_tree import ROOT, TokenTree


def verify_tree(
    target_probs: Tensor,
    node_tokens: Tensor,
    node_probs: Tensor | None,
    trees: Sequence[TokenTree],
    generators: Sequence[torch.Generator | None],
    greedy: Sequence[bool] | None = None,
) -> tuple[Tensor, Tensor, list[tuple[int, ...]]]:
    """Verify a batch of tree drafts (rows may have different trees and sizes).

    Args:
        target_probs: [B, N + 1, V] float32 p: index 0 after the last committed token (the
            root), index n + 1 after node n; row b uses 0..trees[b].num_nodes.
        node_tokens: [B, N] int64 node tokens; entries past a row's nodes are ignored.
        node_probs: [B, N, V] float32 q_i per node (see the module docstring), or None for
            deterministic nodes (one-hot q).
        trees: B tree shapes, N >= every num_nodes.
        generators: B generators (None = torch's default). Row b draws trees[b].num_nodes + 1
            uniforms (column n decides node n, column N the final token) unless it is greedy.
        greedy: [B] host bools, True where p is one-hot (temperature 0); None = none is.

    Returns:
        num_accepted: [B] int64, the accepted path's length.
        tokens: [B, N + 1] int64: row b's output is tokens[b, :num_accepted[b] + 1] (the path's
            tokens, then the recovered or bonus token); the rest is PAD (-1).
        paths: per row, the accepted nodes from depth 1 down.
    """
    if greedy is not None and all(greedy):
        return verify_tree_greedy(target_probs.argmax(-1), node_tokens, trees)
    batch, width, _ = target_probs.shape
    num = width - 1
    device = target_probs.device
    first_child, next_sibling = _links(trees, num, device)  # [B, N + 1], [B, N]
    counts = [tree.num_nodes for tree in trees]
    uniforms = draw_uniforms(target_probs, generators, greedy, counts)  # [B, N + 1] float64
    rows = torch.arange(batch, device=device)  # [B]
    cand = first_child[:, 0]  # [B] the node tried next (-1: none left)
    r = target_probs[:, 0].clone()  # [B, V] the residual at the current node
    path = torch.full((batch, max(num, 1)), PAD, dtype=torch.long, device=device)  # [B, N]
    depth = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
    for _ in range(num):  # each node is tried at most once
        live = cand >= 0  # [B]
        if not bool(live.any()):
            break
        c = cand.clamp(min=0)  # [B]
        x = node_tokens[rows, c]  # [B]
        r_x = r.gather(1, x[:, None]).squeeze(1)  # [B]
        q_x = torch.ones_like(r_x) if node_probs is None else node_probs[rows, c, x]  # [B]
        accept = live & (uniforms[rows, c] * q_x.double() < r_x.double())  # [B] u*q < r
        reject = live & ~accept
        q_c = None if node_probs is None else node_probs[rows, c]  # [B, V]
        r = torch.where(reject[:, None], _residual(r, x, q_c), r)
        r = torch.where(accept[:, None], target_probs[rows, c + 1], r)
        path[rows[accept], depth[accept]] = c[accept]
        depth += accept.long()
        after = torch.where(reject, next_sibling[rows, c], cand)
        cand = torch.where(accept, first_child[rows, c + 1], after)
    final = sample_inverse_cdf(r, uniforms[:, num])  # [B]
    return _outputs(node_tokens, path, depth, final)


def _residual(r: Tensor, x: Tensor, q: Tensor | None) -> Tensor:
    """norm(max(r - q, 0)) after rejecting x: r [B, V] normalised, x [B], q [B, V] or None
    (one-hot on x: x's mass is dropped). A residual of zero mass (r == q, where rejection has
    probability 0) keeps r."""
    residual = r.scatter(1, x[:, None], 0.0) if q is None else (r - q).clamp_min(0.0)
    total = residual.sum(-1, keepdim=True)  # [B, 1]
    return torch.where(total > 0, residual / total.clamp_min(1e-30), r)


def verify_tree_greedy(
    best_token: Tensor, node_tokens: Tensor, trees: Sequence[TokenTree]
) -> tuple[Tensor, Tensor, list[tuple[int, ...]]]:
    """verify_tree for one-hot p, on token ids alone (best_token [B, N + 1]: the argmax of p
    after the root and after each node), without a loop over nodes.

    A node is accepted iff it and all its ancestors carry the argmax of p at their parents;
    the deepest accepted node (the first of equal depth) ends the path. Example: parents
    (-1, -1, 0), tokens (5, 7, 9), argmax after (root, n0, n1, n2) = (7, 9, 3, 4): n0 fails,
    n1 matches (depth 1), n2's parent fails -> path (1,), then the bonus argmax after n1 = 3.
    """
    batch, width = best_token.shape
    num = width - 1
    device = best_token.device
    parents = torch.zeros(batch, num, dtype=torch.long, device=device)  # [B, N] pass indices
    ancestors = torch.zeros(batch, num, num, dtype=torch.bool)  # [B, N, N]
    depths = torch.zeros(batch, num, dtype=torch.long)  # [B, N], 0 on padding
    for row, tree in enumerate(trees):
        k = tree.num_nodes
        parents[row, :k] = torch.tensor(tree.parents, dtype=torch.long) + 1
        ancestors[row, :k, :k] = tree.ancestor_mask()
        depths[row, :k] = torch.tensor(tree.depths, dtype=torch.long)
    ancestors, depths = ancestors.to(device), depths.to(device)
    match = node_tokens == best_token.gather(1, parents)  # [B, N]
    accepted = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N] the whole path matches
    score = torch.where(accepted & (depths > 0), depths, 0)  # [B, N]
    if num:
        num_accepted, best = score.max(-1)  # [B], [B]: the first of the deepest
    else:
        num_accepted = best = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, max(num, 1)), PAD, dtype=torch.long, device=device)  # [B, N]
    accepted = zip(trees, num_accepted.tolist(), best.tolist(), strict=True)
    for row, (tree, n, node) in enumerate(accepted):
        if n:
            path[row, :n] = torch.tensor(tree.path(node), device=device)
    rows = torch.arange(batch, device=device)
    final = best_token[rows, torch.where(num_accepted > 0, best + 1, 0)]  # [B]
    return _outputs(node_tokens, path, num_accepted, final)


def _outputs(
    node_tokens: Tensor, path: Tensor, depth: Tensor, final: Tensor
) -> tuple[Tensor, Tensor, list[tuple[int, ...]]]:
    """(num_accepted [B], tokens [B, N + 1], paths) from the accepted nodes ([B, N], PAD past
    each row's depth), the depths [B] and the final tokens [B]."""
    batch, num = node_tokens.shape
    tokens = torch.full((batch, num + 1), PAD, dtype=torch.long, device=node_tokens.device)
    kept = path[:, :num] >= 0  # [B, N]
    tokens[:, :num] = torch.where(kept, node_tokens.gather(1, path[:, :num].clamp(min=0)), PAD)
    tokens.scatter_(1, depth[:, None], final[:, None])
    paths = [tuple(row[:n]) for row, n in zip(path.tolist(), depth.tolist(), strict=True)]
    return depth, tokens, paths


def _links(trees: Sequence[TokenTree], num: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per row: first_child [B, N + 1] (index 0 = the root, n + 1 = node n; -1 = none) and
    next_sibling [B, N] (-1 = none), as node indices. Example: parents (-1, -1, 0) ->
    first_child [0, 2, -1, -1], next_sibling [1, -1, -1]."""
    first_child = torch.full((len(trees), num + 1), ROOT, dtype=torch.long)
    next_sibling = torch.full((len(trees), max(num, 1)), ROOT, dtype=torch.long)
    for row, tree in enumerate(trees):
        for parent, kids in enumerate((tree.children[-1], *tree.children[:-1])):
            if kids:
                first_child[row, parent] = kids[0]
            for a, b in itertools.pairwise(kids):
                next_sibling[row, a] = b
    return first_child.to(device), next_sibling[:, :num].to(device)
