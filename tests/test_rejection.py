"""verify_chain: hand-built p/q tables, the exactness of the output distribution (chi-square
goodness of fit, which must also catch deliberately biased verifiers), top-k/top-p safety and
seeded determinism."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from spec_cases import chi2_pvalue
from torch import Tensor

from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import PAD, verdicts, verify_chain
from specdecode.sampling_params import SamplingParams

Verifier = Callable[
    [Tensor, Tensor, Tensor | None, Tensor, Sequence[torch.Generator | None]],
    tuple[Tensor, Tensor],
]
V = 6  # vocabulary of the distribution tests
NUM_TRIALS = 50_000  # speculative steps per distribution test
ALPHA = 1e-3  # significance level of the chi-square tests


def _one_hot(ids: list[int], vocab: int = 5) -> Tensor:
    """[len(ids), vocab] float32 rows, one-hot on ids."""
    return torch.eye(vocab)[ids]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _emitted(num_accepted: Tensor, tokens: Tensor) -> list[list[int]]:
    return [row.tolist() for row in (v.tokens for v in verdicts(num_accepted, tokens))]


# ---------------------------------------------------------------------------------------------
# 1. Hand-built tables: greedy (one-hot p) and deterministic-drafter cases, V = 5
# ---------------------------------------------------------------------------------------------

GREEDY_P = _one_hot([2, 4, 1, 3])  # [K + 1 = 4, 5]: argmax chain 2, 4, 1, bonus 3


@pytest.mark.parametrize(
    ("draft", "num_draft", "expected"),
    [
        ([2, 4, 1], 3, [2, 4, 1, 3]),  # perfect match + bonus argmax at position 3
        ([0, 4, 1], 3, [2]),  # mismatch at position 0: argmax p_0, later matches do not count
        ([2, 0, 4], 3, [2, 4]),  # mismatch at position 1: output argmax p_1 = 4
        ([2, 4, 0], 3, [2, 4, 1]),  # mismatch at the last position
        ([0, 0, 0], 0, [2]),  # num_draft = 0: just the bonus from p_0
        ([2, 4, -7], 2, [2, 4, 1]),  # padding (even out of vocab) ignored; bonus from p_2
        ([2, 99, 99], 1, [2, 4]),  # padding after one accepted token; bonus from p_1
    ],
)
@pytest.mark.parametrize("sampled_drafter", [False, True])
def test_greedy_table(
    draft: list[int], num_draft: int, expected: list[int], sampled_drafter: bool
) -> None:
    """Greedy = accept while draft == argmax p, then argmax p; q does not matter."""
    q = torch.softmax(torch.randn(1, 3, 5, generator=_gen(0)), -1) if sampled_drafter else None
    rng_before = torch.get_rng_state()
    n, tokens = verify_chain(
        GREEDY_P[None], torch.tensor([draft]), q, torch.tensor([num_draft]), [None], [True]
    )
    assert torch.equal(torch.get_rng_state(), rng_before), "greedy must draw no random numbers"
    assert n.tolist() == [len(expected) - 1]
    assert _emitted(n, tokens) == [expected]
    assert tokens[0, len(expected) :].tolist() == [PAD] * (4 - len(expected))


def test_greedy_batch_rows_with_different_num_draft() -> None:
    """One batch, each row its own draft length; equals the rows verified one by one."""
    drafts = torch.tensor([[2, 4, 1], [0, 4, 1], [2, 4, 0], [5, 5, 5], [2, 4, -1], [2, 3, 1]])
    num_draft = torch.tensor([3, 3, 3, 0, 2, 3])
    target = GREEDY_P.expand(6, 4, 5)  # [B, K + 1, V]
    gens = [_gen(b) for b in range(6)]
    states = [g.get_state() for g in gens]
    n, tokens = verify_chain(target, drafts, None, num_draft, gens, [True] * 6)
    assert n.tolist() == [3, 0, 2, 0, 2, 1]
    assert _emitted(n, tokens) == [[2, 4, 1, 3], [2], [2, 4, 1], [2], [2, 4, 1], [2, 4]]
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states, strict=True))
    for b in range(6):
        s = slice(b, b + 1)
        n_b, tokens_b = verify_chain(target[s], drafts[s], None, num_draft[s], [None])
        assert torch.equal(n_b, n[s]) and torch.equal(tokens_b, tokens[s])


def test_greedy_matches_reference_on_random_tables() -> None:
    """Many random greedy tables (probs_from_logits, temperature 0) against the obvious loop."""
    batch, k, vocab = 300, 4, 5
    g = _gen(1)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * batch, "cpu")
    target = probs_from_logits(torch.randn(batch, k + 1, vocab, generator=g), st)
    argmax = target.argmax(-1)  # [B, K + 1]
    # draft = argmax, each position corrupted with probability 1/4, so mismatches land anywhere
    corrupt = torch.rand(batch, k, generator=g) < 0.25
    drafts = torch.where(corrupt, torch.randint(0, vocab, (batch, k), generator=g), argmax[:, :k])
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    n, tokens = verify_chain(target, drafts, None, num_draft, [None] * batch)
    for b in range(batch):
        expected = []
        for i in range(int(num_draft[b])):
            expected.append(int(argmax[b, i]))
            if drafts[b, i] != argmax[b, i]:
                break
        else:
            expected.append(int(argmax[b, int(num_draft[b])]))
        assert tokens[b, : int(n[b]) + 1].tolist() == expected


def test_deterministic_drafter_token_with_zero_p_is_always_rejected() -> None:
    """p(x) = 0 (e.g. x outside top-k) -> rejected; recovered from p without x, never p = 0."""
    p = torch.tensor([[0.5, 0.0, 0.3, 0.0, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])  # [K + 1 = 2, 5]
    batch = 400
    n, tokens = verify_chain(
        p.expand(batch, 2, 5),
        torch.ones(batch, 1, dtype=torch.long),
        None,
        torch.ones(batch, dtype=torch.long),
        [_gen(s) for s in range(batch)],
    )
    assert n.eq(0).all()
    assert set(tokens[:, 0].tolist()) == {0, 2, 4}  # all of p's support, nothing else
    assert tokens[:, 1].eq(PAD).all()


def test_deterministic_drafter_residual_removes_the_draft_token() -> None:
    """q one-hot on x: accept x with probability p(x); on rejection x itself never comes back."""
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])  # [2, 5]
    batch = 2000
    n, tokens = verify_chain(
        p.expand(batch, 2, 5),
        torch.zeros(batch, 1, dtype=torch.long),
        None,
        torch.ones(batch, dtype=torch.long),
        [_gen(7)] * batch,
    )
    rejected = n == 0
    assert 0.45 < rejected.float().mean() < 0.55  # accept probability p(0) = 0.5
    assert set(tokens[rejected, 0].tolist()) == {1, 2}  # recovered: never 0, never p = 0
    assert tokens[~rejected].tolist() == [[0, 0]] * int((~rejected).sum())  # bonus argmax of p_1


def test_drafter_equal_to_target_accepts_everything() -> None:
    """q == p -> every draft token is accepted (u * q < q for u < 1); bonus from p_K's support."""
    batch, k = 500, 3
    g = _gen(2)
    p = torch.softmax(torch.randn(batch, k + 1, 5, generator=g), -1)
    p[:, k, 3:] = 0.0  # bonus position: only tokens 0..2 allowed
    drafts = torch.multinomial(p[:, :k].reshape(-1, 5), 1, generator=g).view(batch, k)
    n, tokens = verify_chain(p, drafts, p[:, :k], torch.full((batch,), k), [g] * batch)
    assert n.eq(k).all()
    assert torch.equal(tokens[:, :k], drafts)
    assert set(tokens[:, k].tolist()) <= {0, 1, 2}


def test_all_zero_residual_falls_back_to_p_without_nan() -> None:
    """p == q and the draft token has p = q = 0: rejected, residual empty -> sample p."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])  # [2, 5]
    batch = 200
    n, tokens = verify_chain(
        p.expand(batch, 2, 5),
        torch.full((batch, 1), 3),
        p[None, :1].expand(batch, 1, 5),
        torch.ones(batch, dtype=torch.long),
        [_gen(3)] * batch,
    )
    assert n.eq(0).all()
    assert set(tokens[:, 0].tolist()) == {0, 1}


def test_zero_q_draft_token_is_accepted_without_dividing_by_zero() -> None:
    """q(x) = 0 < p(x): min(1, p / q) = 1, so x is always accepted."""
    p = torch.full((1, 2, 5), 0.2)
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0]]])
    n, tokens = verify_chain(p, torch.tensor([[0]]), q, torch.tensor([1]), [_gen(4)])
    assert n.tolist() == [1] and tokens[0, 0].item() == 0


def test_verdicts_slice_each_row() -> None:
    n = torch.tensor([2, 0])
    tokens = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    out = verdicts(n, tokens)
    assert [v.num_accepted for v in out] == [2, 0]
    assert [v.tokens.tolist() for v in out] == [[5, 6, 7], [8]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_draft": torch.tensor([3])}, "num_draft must be in 0..K"),
        ({"draft_tokens": torch.tensor([[0, 9]])}, "draft tokens must be in 0..V - 1"),
        ({"target_probs": torch.full((1, 2, 5), 0.2)}, "target_probs must be"),
        ({"draft_probs": torch.full((1, 2, 4), 0.25)}, "draft_probs must be"),
        ({"generators": []}, "one generator"),
        ({"greedy": [True, False]}, "greedy needs one entry per row"),
        ({"greedy": [True]}, "marked greedy but its target_probs are not one-hot"),
    ],
)
def test_bad_input_raises_clear_error(kwargs: dict, message: str) -> None:
    args = {
        "target_probs": torch.full((1, 3, 5), 0.2),
        "draft_tokens": torch.tensor([[0, 1]]),
        "draft_probs": None,
        "num_draft": torch.tensor([2]),
        "generators": [None],
        "check": True,
    }
    with pytest.raises(ValueError, match=message):
        verify_chain(**(args | kwargs))


# ---------------------------------------------------------------------------------------------
# 2. The recovered token comes only from where p > q
# ---------------------------------------------------------------------------------------------


def test_recovered_token_only_where_p_exceeds_q() -> None:
    batch, k = 2000, 3
    g = _gen(5)
    p = torch.softmax(torch.randn(batch, k + 1, V, generator=g), -1)  # [B, K + 1, V]
    overweight = torch.tensor([3.0, 3.0, 0, 0, 0, 0])  # q piles mass on tokens 0 and 1
    q = torch.softmax(torch.randn(batch, k, V, generator=g) + overweight, -1)  # [B, K, V]
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    n, tokens = verify_chain(p, drafts, q, num_draft, [_gen(s) for s in range(batch)])
    accepted = torch.arange(k) < n[:, None]  # [B, K]
    assert torch.equal(tokens[:, :k][accepted], drafts[accepted])
    rejected = n < num_draft  # [B]
    assert rejected.sum() > 500  # enough recoveries to mean something
    j, r = n[rejected], tokens[rejected, n[rejected]]  # position and recovered token
    assert (p[rejected, j, r] > q[rejected, j, r]).all()
    bonus = ~rejected
    assert (p[bonus, n[bonus], tokens[bonus, n[bonus]]] > 0).all()


# ---------------------------------------------------------------------------------------------
# 3./4. Distribution: the first two emitted tokens are distributed exactly as p_0(t0) P(t1 | t0)
# ---------------------------------------------------------------------------------------------
# Target and drafter are first-order Markov chains over V tokens: p_0 / q_0 for the first token,
# then P[prev] / Q[prev]. A speculative step from state s drafts x0 ~ q_s, x1 ~ Q[x0] (or fixed
# tokens for a deterministic drafter) and verifies against p_s, P[x0], P[x1]. Each row draws its
# num_draft from {0, 1, 2} (the rest of its draft is garbage padding), so t1 is an accepted token,
# a recovered one, or a bonus one. If a step emits only t0, a second step from state t0 emits t1.


def _chain_tables(target: SamplingParams | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(p0 [V], P [V, V], q0 [V], Q [V, V]): target p, with `target` warping, and drafter q."""
    g = _gen(11)
    logits_p = 1.5 * torch.randn(V + 1, V, generator=g)  # row 0: first token; row 1 + v: P[v]
    logits_q = 1.5 * torch.randn(V + 1, V, generator=g)  # deliberately different from p
    st = SamplingTensors.from_params([target or SamplingParams()] * (V + 1), "cpu")
    p = probs_from_logits(logits_p, st)  # [V + 1, V]
    q = torch.softmax(logits_q, -1)  # unrestricted, even where p is cut by top-k/top-p
    return p[0], p[1:], q[0], q[1:]


def _spec_step(
    first_p: Tensor,
    first_q: Tensor,
    tables: tuple[Tensor, Tensor, Tensor, Tensor],
    verifier: Verifier,
    gen: torch.Generator,
    fixed_draft: tuple[int, int] | None,
) -> tuple[Tensor, Tensor]:
    """One K = 2 step for M rows from first_p / first_q ([M, V]) -> (num_accepted, tokens).

    Row b uses num_draft[b] ~ uniform {0, 1, 2}; its draft beyond that is garbage (padding).
    """
    _, big_p, _, big_q = tables
    rows = first_p.shape[0]
    if fixed_draft is None:
        x0 = torch.multinomial(first_q, 1, generator=gen)[:, 0]  # [M]
        x1 = torch.multinomial(big_q[x0], 1, generator=gen)[:, 0]  # [M]
        draft_probs = torch.stack([first_q, big_q[x0]], dim=1)  # [M, 2, V]
    else:
        x0, x1 = (torch.full((rows,), t) for t in fixed_draft)
        draft_probs = None
    target = torch.stack([first_p, big_p[x0], big_p[x1]], dim=1)  # [M, 3, V]
    num_draft = torch.randint(0, 3, (rows,), generator=gen)  # [M]
    draft = torch.stack([x0, x1], dim=1)  # [M, 2]
    draft = torch.where(torch.arange(2) < num_draft[:, None], draft, (draft + 1) % V)  # padding
    n, tokens = verifier(target, draft, draft_probs, num_draft, [gen] * rows)
    assert (n <= num_draft).all()
    emitted = torch.arange(3) <= n[:, None]  # [M, 3]
    p_emitted = target.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1)  # [M, 3]
    assert (p_emitted[emitted] > 0).all(), "emitted a token with target probability 0"
    return n, tokens


def _joint_counts(
    tables: tuple[Tensor, Tensor, Tensor, Tensor],
    verifier: Verifier,
    seed: int,
    fixed_draft: tuple[int, int] | None = None,
) -> Tensor:
    """Counts [V, V] of the first two emitted tokens (t0, t1) over NUM_TRIALS runs."""
    p0, big_p, q0, big_q = tables
    gen = _gen(seed)
    first_p, first_q = p0.expand(NUM_TRIALS, V), q0.expand(NUM_TRIALS, V)
    n, tokens = _spec_step(first_p, first_q, tables, verifier, gen, fixed_draft)
    t0, t1 = tokens[:, 0], tokens[:, 1].clone()
    short = n == 0  # only t0 emitted: the next step, from state t0, emits t1
    if short.any():
        state = t0[short]
        _, more = _spec_step(big_p[state], big_q[state], tables, verifier, gen, fixed_draft)
        t1[short] = more[:, 0]
    return torch.bincount(t0 * V + t1, minlength=V * V).view(V, V)


def _target_joint(tables: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    p0, big_p, _, _ = tables
    return p0[:, None] * big_p  # [V, V]: p(t0, t1) = p_0(t0) P(t1 | t0)


def test_chi2_pvalue_matches_known_quantiles() -> None:
    """The home-made survival function agrees with textbook chi-square 5% quantiles."""
    for df, x in [(1, 3.841), (5, 11.070), (34, 48.602)]:
        p = torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(x / 2)
        )
        assert abs(float(p) - 0.05) < 1e-3


# The biased verifiers: same signature as verify_chain, one wrong rule each. They use the row's
# generator only through generators[0] (the harness shares one generator across rows).


def _always_accept(target_probs, draft_tokens, draft_probs, num_draft, generators):
    """BIASED: keeps every draft token, then a bonus token from p."""
    rows = torch.arange(draft_tokens.shape[0])
    bonus = torch.multinomial(target_probs[rows, num_draft], 1, generator=generators[0])
    tokens = torch.cat([draft_tokens, torch.full_like(bonus, PAD)], dim=1)
    return num_draft.clone(), tokens.scatter_(1, num_draft[:, None], bonus)


def _recover_from_p(target_probs, draft_tokens, draft_probs, num_draft, generators):
    """BIASED: the right accept rule, but after a rejection the token is drawn from p, not from
    the residual norm(max(p - q, 0))."""
    batch, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x)  # deterministic drafter: q one-hot on the draft token
    if draft_probs is not None:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    u = torch.rand(batch, k, generator=generators[0])
    n = ((u * q_x < p_x) & (torch.arange(k) < num_draft[:, None])).long().cumprod(-1).sum(-1)
    final = torch.multinomial(target_probs[torch.arange(batch), n], 1, generator=generators[0])
    tokens = torch.where(torch.arange(k) < n[:, None], draft_tokens, PAD)
    tokens = torch.cat([tokens, torch.full_like(final, PAD)], dim=1)  # [B, K + 1]
    return n, tokens.scatter_(1, n[:, None], final)


@pytest.mark.parametrize("fixed_draft", [None, (0, 1)], ids=["sampled_q", "deterministic_q"])
def test_output_distribution_equals_target(fixed_draft: tuple[int, int] | None) -> None:
    """Sampled drafter q != p, and a drafter always proposing 0 then 1 (draft_probs=None)."""
    tables = _chain_tables()
    counts = _joint_counts(tables, verify_chain, seed=100, fixed_draft=fixed_draft)
    assert counts.sum() == NUM_TRIALS
    pvalue = chi2_pvalue(counts, _target_joint(tables))
    print(f"correct verifier, {fixed_draft=}: p-value {pvalue:.4g}")
    assert pvalue > ALPHA


def _bonus_off_by_one(target_probs, draft_tokens, draft_probs, num_draft, generators):
    """BIASED: after a full accept, draws the bonus token from p at the last draft position
    num_draft - 1 instead of at position num_draft."""
    rows = torch.arange(draft_tokens.shape[0])
    shifted = target_probs.clone()
    shifted[rows, num_draft] = target_probs[rows, (num_draft - 1).clamp_min(0)]
    return verify_chain(shifted, draft_tokens, draft_probs, num_draft, generators)


@pytest.mark.parametrize("biased", [_always_accept, _recover_from_p, _bonus_off_by_one])
@pytest.mark.parametrize("fixed_draft", [None, (0, 1)], ids=["sampled_q", "deterministic_q"])
def test_distribution_test_catches_biased_verifier(
    biased: Verifier, fixed_draft: tuple[int, int] | None
) -> None:
    """The harness above has the power to reject each biased rule."""
    tables = _chain_tables()
    counts = _joint_counts(tables, biased, seed=100, fixed_draft=fixed_draft)
    pvalue = chi2_pvalue(counts, _target_joint(tables))
    print(f"biased {biased.__name__}, {fixed_draft=}: p-value {pvalue:.4g}")
    assert pvalue < ALPHA


@pytest.mark.parametrize(
    "target",
    [SamplingParams(top_k=3), SamplingParams(top_p=0.6), SamplingParams(temperature=0.7, top_k=4)],
    ids=["top_k=3", "top_p=0.6", "T=0.7,top_k=4"],
)
@pytest.mark.parametrize("fixed_draft", [None, (0, 1)], ids=["sampled_q", "deterministic_q"])
def test_top_k_top_p_target_distribution_and_support(
    target: SamplingParams, fixed_draft: tuple[int, int] | None
) -> None:
    """Warped target p, unrestricted q: exact distribution, and no token outside p's support
    (asserted per step in _spec_step and per (t0, t1) cell here)."""
    tables = _chain_tables(target)
    expected = _target_joint(tables)
    assert (expected == 0).sum() >= V * V // 3  # the warping really removes tokens
    counts = _joint_counts(tables, verify_chain, seed=200, fixed_draft=fixed_draft)
    assert counts[expected == 0].sum() == 0
    pvalue = chi2_pvalue(counts, expected)
    print(f"correct verifier, {target}, {fixed_draft=}: p-value {pvalue:.4g}")
    assert pvalue > ALPHA


# ---------------------------------------------------------------------------------------------
# 5. Seeded determinism
# ---------------------------------------------------------------------------------------------


def _random_batch(batch: int = 64, k: int = 4) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = _gen(6)
    p = torch.softmax(torch.randn(batch, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(batch, k, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(batch, k)
    return p, drafts, q, torch.randint(0, k + 1, (batch,), generator=g)


def test_same_seeds_same_output_different_seeds_different() -> None:
    p, drafts, q, num_draft = _random_batch()
    run = lambda seeds: verify_chain(p, drafts, q, num_draft, [_gen(s) for s in seeds])  # noqa: E731
    n1, t1 = run(range(64))
    n2, t2 = run(range(64))
    assert torch.equal(n1, n2) and torch.equal(t1, t2)
    n3, t3 = run(range(1000, 1064))
    assert not (torch.equal(n1, n3) and torch.equal(t1, t3))


def test_row_output_depends_only_on_its_own_generator() -> None:
    """Batching does not change a row's result: row b alone with seed b gives the same."""
    p, drafts, q, num_draft = _random_batch(batch=16)
    n, tokens = verify_chain(p, drafts, q, num_draft, [_gen(s) for s in range(16)])
    for b in range(16):
        s = slice(b, b + 1)
        n_b, tokens_b = verify_chain(p[s], drafts[s], q[s], num_draft[s], [_gen(b)])
        assert torch.equal(n_b, n[s]) and torch.equal(tokens_b, tokens[s])


def test_greedy_row_in_mixed_batch_leaves_its_generator_untouched() -> None:
    """A greedy row (temperature 0: one-hot p) draws nothing; a sampled row next to it does."""
    p, drafts, q, num_draft = _random_batch(batch=2, k=2)
    p[0] = torch.eye(V)[[3, 1, 4]]  # greedy row
    gens = [_gen(0), _gen(1)]
    before = [g.get_state() for g in gens]
    verify_chain(p, drafts, q, num_draft, gens, greedy=[True, False])
    assert torch.equal(gens[0].get_state(), before[0])
    assert not torch.equal(gens[1].get_state(), before[1])
