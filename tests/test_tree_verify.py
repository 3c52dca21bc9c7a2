"""verify_tree: the greedy walk, and the exactness of the emitted distribution (chi-square over
20k samples) for i.i.d., without-replacement and deterministic children, with top-k / top-p
targets; verifiers with a known bug must fail the same test."""

from __future__ import annotations

import pytest
import torch
from spec_cases import chi2_pvalue
from torch import Tensor

from specdecode.sampling import tree as tree_module
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.tree import verify_tree
from specdecode.sampling_params import SamplingParams
from specdecode.tree.token_tree import TokenTree

V = 8
NUM_SAMPLES = 20_000
ALPHA = 1e-3
# root -> 3 children; each child -> 2 children (9 nodes)
SHAPE = TokenTree((-1, -1, -1, 0, 0, 1, 1, 2, 2))


def _one_hot(ids: list[int]) -> Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_walk_follows_the_argmax() -> None:
    tree = TokenTree((-1, -1, 0))  # n0 -> n2, n1
    tokens = torch.tensor([[5, 7, 3]])
    p = _one_hot([7, 1, 3, 4])[None]  # argmax after root 7 (n1), after n1: 3 (n2 is n0's)
    for greedy in ([True], None):
        n, out, paths = verify_tree(p, tokens, None, [tree], [None], greedy)
        assert n.tolist() == [1] and paths == [(1,)] and out.tolist() == [[7, 3, -1, -1]]
    p = _one_hot([5, 3, 0, 2])[None]  # n0 then n2 accepted, bonus 2
    n, out, paths = verify_tree(p, tokens, None, [tree], [None], [True])
    assert n.tolist() == [2] and paths == [(0, 2)] and out.tolist() == [[5, 3, 2, -1]]


def test_greedy_path_equals_the_general_walk_on_random_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        trees = [
            TokenTree(tuple(int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)))
            for n in (6, 3, 0)
        ]
        width = 6
        tokens = torch.zeros(3, width, dtype=torch.long)
        for row, tree in enumerate(trees):  # siblings carry distinct tokens (else the walk
            for kids in tree.children:  # takes the first match, the greedy path the deepest)
                tokens[row, list(kids)] = torch.randperm(V, generator=gen)[: len(kids)] % V
        p = _one_hot(torch.randint(0, 3, (3 * (width + 1),), generator=gen).tolist())  # hits
        p = p.view(3, width + 1, V)
        fast = verify_tree(p, tokens, None, trees, [gen] * 3, [True] * 3)
        walk = verify_tree(p, tokens, None, trees, [gen] * 3, None)
        assert torch.equal(fast[0], walk[0]) and torch.equal(fast[1], walk[1])
        assert fast[2] == walk[2]


def _tables(target: SamplingParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(p0 [V], P [V, V], q0 [V], Q [V, V]): target p warped by `target`, drafter q unwarped
    (deliberately different from p, and positive where p is cut)."""
    g = torch.Generator().manual_seed(11)
    logits_p = 1.5 * torch.randn(V + 1, V, generator=g)
    logits_q = 1.5 * torch.randn(V + 1, V, generator=g)
    st = SamplingTensors.from_params([target] * (V + 1), "cpu")
    p = probs_from_logits(logits_p, st)
    q = torch.softmax(logits_q, -1)
    return p[0], p[1:], q[0], q[1:]


def _children(q: Tensor, count: int, how: str, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Draw `count` children from each row of q ([M, V]) -> tokens [M, count] and the q_i
    each was drawn from [M, count, V] (`how`: iid, without (replacement) or top (k))."""
    rows = q.shape[0]
    if how == "iid":
        tokens = torch.multinomial(q, count, replacement=True, generator=gen)
        return tokens, q[:, None].expand(rows, count, V)
    if how == "top":
        return q.topk(count, dim=-1).indices, _one_hot([0]).expand(rows, count, V)
    tokens = torch.multinomial(q, count, replacement=False, generator=gen)  # sequential draws
    dists, left = [], q.clone()
    for i in range(count):
        dists.append(left / left.sum(-1, keepdim=True))
        left = left.scatter(1, tokens[:, i : i + 1], 0.0)
    return tokens, torch.stack(dists, dim=1)


def _first_two(tables, how: str, seed: int, verifier_probs: str = "true") -> Tensor:
    """Counts [V, V] of the first two tokens emitted from SHAPE-trees over NUM_SAMPLES rows;
    a row that emitted one token gets its second from p (what a next step would give)."""
    p0, big_p, q0, big_q = tables
    gen = torch.Generator().manual_seed(seed)
    m = NUM_SAMPLES
    first, first_q = _children(q0.expand(m, V), 3, how, gen)  # [M, 3], [M, 3, V]
    second, second_q = [], []
    for a in range(3):
        tok, dist = _children(big_q[first[:, a]], 2, how, gen)
        second.append(tok)
        second_q.append(dist)
    tokens = torch.cat([first, *second], dim=1)  # [M, 9] in SHAPE's node order
    probs = torch.cat([first_q, *second_q], dim=1)  # [M, 9, V]
    node_p = big_p[tokens]  # [M, 9, V]: p after a depth-1 node is P[its token]
    target = torch.cat([p0.expand(m, 1, V), node_p], dim=1)  # [M, 10, V]
    node_probs = None if how == "top" or verifier_probs == "none" else probs
    n, out, paths = verify_tree(target, tokens, node_probs, [SHAPE] * m, [gen] * m, None)
    assert (n <= 2).all() and all(len(path) == k for path, k in zip(paths, n.tolist(), strict=True))
    t0, t1 = out[:, 0], out[:, 1].clone()
    short = n == 0
    t1[short] = torch.multinomial(big_p[t0[short]], 1, generator=gen)[:, 0]
    return torch.bincount(t0 * V + t1, minlength=V * V).view(V, V)


TARGETS = {
    "plain": SamplingParams(),
    "top_k": SamplingParams(top_k=4),
    "top_p": SamplingParams(top_p=0.7, temperature=0.8),
}


@pytest.mark.parametrize("how", ["iid", "without", "top"])
@pytest.mark.parametrize("target", TARGETS)
def test_tree_sampling_is_exact(how: str, target: str) -> None:
    tables = _tables(TARGETS[target])
    counts = _first_two(tables, how, seed=1)
    expected = tables[0][:, None] * tables[1]  # p(t0) P(t1 | t0)
    assert chi2_pvalue(counts, expected) > ALPHA


@pytest.mark.parametrize("how", ["iid", "top"])
def test_a_verifier_that_skips_the_residual_update_fails(how: str, monkeypatch) -> None:
    monkeypatch.setattr(tree_module, "_residual", lambda r, x, q: r)
    tables = _tables(TARGETS["plain"])
    counts = _first_two(tables, how, seed=2)
    assert chi2_pvalue(counts, tables[0][:, None] * tables[1]) < 1e-6


def test_a_verifier_that_drops_only_the_rejected_token_fails(monkeypatch) -> None:
    """Sampled children verified with min(1, r/q) but a residual that only drops the rejected
    token (as for deterministic children) is biased."""
    residual = tree_module._residual
    monkeypatch.setattr(tree_module, "_residual", lambda r, x, q: residual(r, x, None))
    tables = _tables(TARGETS["plain"])
    counts = _first_two(tables, "iid", seed=3)
    assert chi2_pvalue(counts, tables[0][:, None] * tables[1]) < 1e-6


def test_sampled_children_verified_as_deterministic_ones_stay_exact() -> None:
    """Candidates the verifier treats as fixed (q one-hot) are exact however they were chosen,
    since the choice does not depend on the verifier's random numbers (it only accepts less)."""
    tables = _tables(TARGETS["plain"])
    counts = _first_two(tables, "iid", seed=3, verifier_probs="none")
    assert chi2_pvalue(counts, tables[0][:, None] * tables[1]) > ALPHA
