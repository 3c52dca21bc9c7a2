"""Adaptive draft length: the cost rule's choices, Hugging Face's +2/-1 schedule, probing, and
through the engine: never above K, never a different output."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq, budgets

from specdecode.drafters.base import SpeculativeConfig
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.registry import as_speculative_config, parse_speculative_config
from specdecode.engine.costs import PassCosts, expected_tokens, nondecreasing
from specdecode.engine.draft_length import PROBE_EVERY, DraftLength
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.tree.token_tree import TokenTree
from specdecode.types import NO_TARGET_OUTPUTS, Draft, DraftBudget, Verdict


def _costs(policy: str, k: int, seconds: dict[int, float], draft_s: float) -> DraftLength:
    """A policy whose passes are seeded with seconds by total width: a pass of B rows of n
    tokens costs seconds[B * n] (the widths given; `PassCosts` reads between them)."""
    length = DraftLength(policy, k)
    shapes = [(rows, n) for rows in range(1, 17) for n in range(1, k + 2)]
    length.passes.seed({(r, n): seconds[r * n] for r, n in shapes if r * n in seconds})
    length.draft_s_per_token = draft_s
    return length


def _step(length: DraftLength, rid: str, drafted: int, accepted: int) -> None:
    """Feed one verdict, with the pass seconds the policy already holds (timing unchanged)."""
    draft = Draft(torch.zeros(drafted, dtype=torch.long))
    verdict = Verdict(accepted, torch.zeros(accepted + 1, dtype=torch.long))
    verify_s = length.passes.estimate(1, 1 + drafted) or 0.07
    length.observe([rid], [draft], [verdict], drafted * length.draft_s_per_token, verify_s)


def test_the_docstring_example() -> None:
    length = _costs("cost", 3, {1: 0.070, 2: 0.070, 3: 0.072, 4: 0.075}, 0.025)
    assert length.best_k(0.6, 1) == 1
    assert length.best_k(0.95, 1) == 3
    assert length.best_k(0.1, 1) == 0
    assert expected_tokens(0.6, 2) == pytest.approx(1.96)


def test_chain_bounds_price_each_further_draft_token() -> None:
    """The module docstring's example: after 1 token (25 + 2) / (0.6 * 70), after 2
    (25 + 3) / 42; none under the other policies, before costs, or for limits below 2."""
    length = _costs("cost", 3, {1: 0.070, 2: 0.070, 3: 0.072, 4: 0.075}, 0.025)
    length._request("a").successes, length._request("a").failures = 6.0, 4.0  # rate 0.6
    length._request("b").successes, length._request("b").failures = 9.0, 1.0  # rate 0.9
    bounds = length.chain_bounds(["a"], [3])
    assert bounds == [pytest.approx((27 / 42, 28 / 42))]
    assert length.chain_bounds(["a"], [1]) == [()] and length.chain_bounds(["a"], [0]) == [()]
    assert length.chain_bounds(["a", "b"], [3, 0])[1] == ()  # a batch of mixed limits
    # a surer request's bounds are lower: its next token is worth more
    (sure,) = length.chain_bounds(["b"], [3])
    assert sure == pytest.approx((27 / 63, 28 / 63))
    assert DraftLength("fixed", 3).chain_bounds(["a"], [3]) == [()]
    assert DraftLength("cost", 3).chain_bounds(["a"], [3]) == [()]  # nothing measured yet


def test_a_draft_model_stops_a_chain_below_its_bound(tiny_model_dir: Path) -> None:
    """A bound above 1 stops every chain after one token, a bound of 0 never; the second
    bound applies to the product of both tokens' probabilities."""
    model = load_model(tiny_model_dir, dtype="float32")
    drafter = DraftModelDrafter(model, 4, model.config.vocab_size)
    ids = PROMPTS[0]["prompt_token_ids"]

    def drafted(bounds: tuple[float, ...], rid: str) -> int:
        seq = FakeSeq(rid, list(ids), len(ids), GREEDY)
        return int(drafter.propose([seq], [DraftBudget(4, bounds)])[0].tokens.numel())

    assert drafted((), "free") == 4
    assert drafted((0.0, 0.0, 0.0), "zero") == 4
    assert drafted((1.5, 0.0, 0.0), "above-one") == 1
    assert drafted((0.0, 1.5, 0.0), "second") == 2


def test_the_cost_rule_measures_the_passes_of_each_new_batch_size(tiny_model_dir: Path) -> None:
    """Before a batch is first priced, its passes are measured: 1, 2 and 4 rows for a batch
    of 4, of 1, 2, 3 and K + 1 = 4 tokens each; a later batch of 3 measures nothing more."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "draft_length": "cost"}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    passes = llm.engine.draft_length.passes
    llm.generate(PROMPTS, GREEDY)
    assert sorted(passes.seeded) == [(r, w) for r in (1, 2, 4) for w in (1, 2, 3, 4)]
    assert passes.unseeded(3) == [] and passes.unseeded(6) == [6]
    assert PassCosts().unseeded(5) == [1, 2, 4, 5]


def test_pass_costs_interpolate_between_measured_shapes() -> None:
    costs = PassCosts()
    assert costs.estimate(1, 3) is None
    costs.observe(1, 2, 1.0)
    costs.observe(1, 6, 3.0)
    assert costs.estimate(1, 4) == pytest.approx(2.0)
    assert costs.estimate(1, 1) == costs.estimate(1, 2) == 1.0 and costs.estimate(1, 9) == 3.0
    assert costs.estimate(4, 4) == pytest.approx(2.0)  # flat beyond the row counts run
    costs.observe(1, 2, 2.0)  # a running average
    assert 1.0 < costs.estimate(1, 2) < 2.0


def test_seeded_pass_costs_follow_the_passes_run() -> None:
    """Seeds are read between row counts and widths, and scaled by how the passes run at the
    same row count compare with them (contexts grow after the server measured its seeds)."""
    costs = PassCosts()
    costs.seed({(1, 1): 1.0, (1, 3): 2.0, (4, 1): 2.0, (4, 3): 4.0})
    assert costs.estimate(2, 1) == pytest.approx(4 / 3)  # a third of the way from 1 to 4 rows
    assert costs.estimate(4, 2) == pytest.approx(3.0)
    costs.observe(4, 1, 3.0)  # the 4-row passes run 1.5x the seeds
    assert costs.estimate(4, 3) == pytest.approx(6.0)
    assert costs.estimate(1, 3) == 2.0  # no 1-row pass has run
    costs.observe(4, 3, 5.0)
    assert costs.estimate(4, 3) == 5.0  # run: as measured
    assert costs.estimate(4, 2) == pytest.approx(3.0 * 1.5)  # the nearest run width, 1
    costs.seed({(8, 1): 3.0, (8, 2): 5.0, (8, 3): 4.0, (8, 4): 6.0})  # one noisy timing
    assert [costs.estimate(8, n) for n in (1, 2, 3, 4)] == [3.0, 4.5, 4.5, 6.0]
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]


def test_cost_rule_picks_one_k_for_the_batch_from_the_pass_costs() -> None:
    """Memory-bound up to 16 tokens, then compute-bound (time grows with the width): one
    request drafts at a = 0.5, a batch of 16 does not; one eager request does not widen a
    batch of reluctant ones, since the pass pads every row to the longest draft."""
    seconds = {w: 0.07 if w <= 16 else 0.07 * w / 16 for w in (1, 2, 4, 8, 16, 32, 64, 144)}
    length = _costs("cost", 8, seconds, 0.0)
    assert length.best_k(0.5, 1) >= 3
    assert length.best_k(0.5, 16) == 0
    assert length.best_k([0.99] + [0.1] * 15) == 0
    for rid in "abc":
        _step(length, rid, 2, 2)
    limits = length.limits(["a", "b", "c"])
    assert len(set(limits)) == 1 and limits[0] > 0  # one k for the whole batch


def _tree_costs(trees: bool) -> DraftLength:
    """The module docstring's tree example: K = 4 nodes over D = 2 levels, d = 9 ms a level,
    t(1, 1) = 28 ms, t(1, 2) = 28.5 ms, t(1, 5) = 31 ms (read linearly in between)."""
    length = DraftLength("cost", 4, trees=trees)
    length.passes.seed({(1, 1): 0.028, (1, 2): 0.0285, (1, 5): 0.031})
    length.draft_s_per_token = 0.009
    return length


def _tree_step(length: DraftLength, rid: str, accepted: int, draft_s: float) -> None:
    """One request's 4-node tree of depth 2 (two children of the root, one child each),
    `accepted` levels of it accepted, drafted in `draft_s` seconds."""
    draft = Draft(torch.zeros(4, dtype=torch.long), tree=TokenTree((-1, -1, 0, 1)))
    verdict = Verdict(accepted, torch.zeros(accepted + 1, dtype=torch.long))
    length.observe([rid], [draft], [verdict], draft_s, 0.031)


def test_trees_are_priced_whole_at_their_measured_depth() -> None:
    """A grown tree drafts all K nodes or none, priced at its levels' drafting and its mean
    depth's expected tokens: the docstring's example drafts (40 tok/s over 35.7), where
    pricing the same tree as a chain of nodes cuts it to a 1-node tree."""
    as_chain = _tree_costs(trees=False)
    assert as_chain.best_k(0.6) == 1
    tree = _tree_costs(trees=True)
    assert tree.best_k(0.6) == 4  # before any tree: unmeasured, so K
    _tree_step(tree, "a", 1, 0.018)  # 18 ms for 2 levels: d = 9 ms; depth 2
    assert tree.tree_depth == 2.0 and tree.draft_s_per_token == pytest.approx(0.009)
    assert tree.best_k(0.6) == 4
    assert tree.best_k(0.2) == 0  # 1.24 / 49 ms = 25 tok/s: not worth it
    seen = set()
    for rate in (0.05, 0.3, 0.5, 0.7, 0.95):
        for _ in range(3):
            _tree_step(tree, "b", round(2 * rate), 0.018)
        seen.update(tree.limits(["b"]))
    assert seen <= {0, 4} and 4 in seen
    assert tree.chain_bounds(["b"], [4]) == [()]  # bounds are for chains


def test_cost_policy_stops_drafting_where_nothing_pays_and_probes_later() -> None:
    length = _costs("cost", 6, {w: 0.07 + 0.01 * w for w in range(1, 8)}, 0.02)
    assert length.limits(["a"])[0] >= 1  # the prior rate, 0.5, pays
    for _ in range(10):
        _step(length, "a", 2, 0)
    assert length.limits(["a"]) == [0]
    for _ in range(PROBE_EVERY - 1):
        _step(length, "a", 0, 0)
        assert length.limits(["a"]) == [0]
    _step(length, "a", 0, 0)
    assert length.limits(["a"])[0] >= 1  # a probe
    for _ in range(10):
        _step(length, "a", 4, 4)
    assert length.limits(["a"])[0] >= 4  # the rate climbed back
    length.release("a")
    length.release("unknown")
    assert not length._requests


def test_heuristic_schedule_adds_two_after_a_full_accept_and_drops_one_otherwise() -> None:
    length = DraftLength("heuristic", 5)
    assert length.limits(["a", "b"]) == [5, 5]
    _step(length, "a", 5, 2)
    _step(length, "a", 4, 1)
    assert length.limits(["a"]) == [3]
    _step(length, "a", 3, 3)
    assert length.limits(["a"]) == [5]  # +2, at most K
    _step(length, "a", 5, 5)
    assert length.limits(["a"]) == [5]
    for _ in range(9):
        _step(length, "a", 1, 0)
    assert length.limits(["a"]) == [1]  # at least 1


def test_fixed_is_always_k() -> None:
    length = DraftLength("fixed", 4)
    _step(length, "a", 4, 0)
    assert length.limits(["a", "b"]) == [4, 4] and not length._requests


def test_the_policy_is_validated() -> None:
    with pytest.raises(UserError, match="draft_length must be one of fixed, heuristic, cost"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                  "draft_length": "auto"})  # fmt: skip
    with pytest.raises(UserError, match="draft_length must be one of"):
        DraftLength("sometimes", 3)


def test_the_policy_travels_beside_the_drafters_config_not_in_it() -> None:
    """`parse_speculative_config` takes "draft_length" out of vLLM's dict into the envelope
    (default: the method's own), and `as_speculative_config` puts it back."""
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    draft = parse_speculative_config({"model": "m", "num_speculative_tokens": 3})
    assert (ngram.draft_length, draft.draft_length) == ("fixed", "cost")  # each method's default
    assert not hasattr(ngram.drafter, "draft_length")  # the drafter's config has no such field
    asked = {"method": "ngram", "num_speculative_tokens": 3, "draft_length": "heuristic"}
    spec = parse_speculative_config(asked)
    assert spec == SpeculativeConfig(ngram.drafter, "heuristic")
    assert parse_speculative_config(as_speculative_config(spec)) == spec  # a round trip
    assert parse_speculative_config(spec) is spec
    assert parse_speculative_config(draft.drafter) == draft  # a bare config: its default
    with pytest.raises(UserError, match=r"allowed: .*'draft_length'"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "dl": 1})


class LimitSpy:
    """Wraps a drafter; records every limit it was given."""

    def __init__(self, inner: object) -> None:
        self.inner, self.seen, self.asked = inner, [], []
        self.needs, self.names, self.setup_s = inner.needs, inner.names, inner.setup_s

    def propose(self, seqs, budgets):
        self.seen += [b.max_tokens for b in budgets]
        return self.inner.propose(seqs, budgets)

    def catch_up(self, seq) -> int:
        self.asked.append(seq.request_id)
        return self.inner.catch_up(seq)

    def commit(self, seq, verdict, target) -> None:
        self.inner.commit(seq, verdict, target)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


@pytest.mark.parametrize("policy", ["heuristic", "cost"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_tree"])
def test_adaptive_length_never_exceeds_k_nor_changes_the_output(
    tiny_model_dir: Path, policy: str, method: str
) -> None:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    config = {"method": method, "num_speculative_tokens": 5, "draft_length": policy}
    if method.startswith("draft_model"):
        config["method"], config["model"] = "draft_model", str(tiny_model_dir)
    else:
        config["prompt_lookup_min"] = 1
    if method == "draft_model_tree":
        config |= {"tree_width": 2, "tree_depth": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    spy = LimitSpy(llm.engine.drafter)
    llm.engine.drafter = spy
    length, chosen = llm.engine.draft_length, []
    rule = length.limits
    length.limits = lambda *args: chosen.extend(rule(*args)) or length.last_limits
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert spy.seen and max(spy.seen) <= 5
    if method == "draft_model_tree" and policy == "cost":  # a grown tree: all or nothing
        # (the step may cap a limit by the tokens a request has left)
        assert length.trees and set(chosen) <= {0, 5} and 5 in chosen
    assert llm.engine.draft_length.passes.seconds  # it measured its passes
    assert not llm.engine.draft_length._requests  # released


def test_a_request_that_cannot_draft_is_not_priced_a_catch_up(tiny_model_dir: Path) -> None:
    """A request whose own K is 0 (or with one token left) never drafts this step: its
    catch-up is not asked for, so the cost rule does not bill it a share of another's."""
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 3}  # "cost" by default
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    spy = LimitSpy(llm.engine.drafter)
    llm.engine.drafter = spy
    never = SamplingParams(temperature=0.0, max_tokens=8, num_speculative_tokens=0)
    llm.generate(PROMPTS[0], never)
    assert not spy.asked and set(spy.seen) == {0}
    llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2))
    assert not spy.asked  # its one step left a single token to generate


def test_a_confidence_threshold_cuts_chains_and_keeps_the_output(tiny_model_dir: Path) -> None:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    lengths = {}
    for bound in (None, 0.9):
        # a fixed K: the default ("cost") follows this machine's measured pass times
        config = {"model": str(tiny_model_dir), "num_speculative_tokens": 5,
                  "confidence_threshold": bound, "draft_length": "fixed"}  # fmt: skip
        llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        spec = llm.spec_metrics
        lengths[bound] = spec.num_draft_tokens / spec.num_drafts
    assert lengths[0.9] < lengths[None]
    with pytest.raises(UserError, match=r"confidence_threshold must be None or in 0\.\.1"):
        parse_speculative_config({"model": "m", "num_speculative_tokens": 3,
                                  "confidence_threshold": 2})  # fmt: skip
    with pytest.raises(UserError, match="takes neither staged nor tree_width > 1"):
        parse_speculative_config({"model": "m", "num_speculative_tokens": 3,
                                  "confidence_threshold": 0.5, "tree_width": 2})  # fmt: skip


def test_a_batch_that_drafts_nothing_probes_together_and_less_often() -> None:
    seconds = {w: 0.07 * (1 + max(0, w - 2) / 4) for w in range(1, 20)}  # wider costs more
    length = _costs("cost", 4, seconds, 0.005)
    assert length.best_k([1.0, 1.0]) > 0  # drafts that always hold would pay: worth probing
    for rid in "ab":
        for _ in range(10):
            _step(length, rid, 2, 0)
    limits = [length.limits(["a", "b"]) for _ in range(PROBE_EVERY * 2 + 1)]
    assert limits[:-1] == [[0, 0]] * (PROBE_EVERY * 2)  # 8 x B idle steps first
    assert limits[-1][0] >= 1 and limits[-1][0] == limits[-1][1]  # then both, one k
    assert length.limits(["a", "b"]) == [0, 0]


def test_requests_that_rarely_find_a_draft_count_for_less() -> None:
    """A lookup drafter drafts nothing in some steps: the rule weighs each request's gain by
    the share of steps in which it drafted when it could."""
    seconds = {w: 0.07 * (1 + max(0, w - 4) / 8) for w in range(1, 40)}
    length = _costs("cost", 4, seconds, 0.0)
    assert length.best_k([0.8] * 4) >= 1
    assert length.best_k([0.8] * 4, available=[0.1] * 4) == 0
    for _ in range(20):  # offered a draft every step, never drafted one
        assert length.limits(["a"])[0] >= 1
        _step(length, "a", 0, 0)
    req = length._requests["a"]
    assert req.hits / req.offers < 0.2


def test_no_probe_where_not_even_perfect_drafts_would_pay() -> None:
    """A costly drafter in a batch: each draft token costs every row 50 ms, a pass barely
    grows; even drafts that are always accepted lose, so the batch never probes."""
    seconds = {w: 0.07 * (1 + w / 64) for w in range(1, 80)}
    length = _costs("cost", 3, seconds, 0.05)
    assert length.best_k([1.0] * 8) == 0
    for _ in range(PROBE_EVERY * 8 * 3):
        assert length.limits([str(i) for i in range(8)]) == [0] * 8


def test_a_catch_up_is_drafted_only_where_the_drafts_would_repay_it() -> None:
    """A draft model prefills a request's prompt before its first draft: the cost rule lets a
    request draft only if its drafts would save more over its remaining tokens than the
    catch-up costs (s per token, learned from the steps that paid one)."""
    seconds = {1: 0.070, 2: 0.071, 3: 0.072, 4: 0.074}
    length = _costs("cost", 3, seconds, 0.010)
    assert length.best_k(0.5) >= 1  # the prior rate pays, once caught up
    # nothing measured yet: the first request pays its prompt's catch-up, and it is learned
    assert length.limits(["a"], [200], [64])[0] >= 1
    _step(length, "a", 3, 1)  # observe: the draft passes, then the one-time work below
    length.observe(["a"], [Draft(torch.zeros(0, dtype=torch.long))],
                   [Verdict(0, torch.zeros(1, dtype=torch.long))], 0.0, 0.07,
                   setup_s=2.0)  # fmt: skip
    assert length.setup_s_per_token == 0.0  # "a" was not offered a draft in that step
    assert length.limits(["a"], [0], [64])[0] >= 1  # caught up: nothing to read alone
    length.observe(["a"], [Draft(torch.zeros(3, dtype=torch.long))],
                   [Verdict(1, torch.zeros(2, dtype=torch.long))], 0.03, 0.072,
                   setup_s=0.0)  # fmt: skip
    assert length.setup_s_per_token == 0.0
    b = length.limits(["b"], [200], [64])  # a new request: a 200-token prompt to read
    assert b[0] >= 1
    length.observe(["b"], [Draft(torch.zeros(3, dtype=torch.long))],
                   [Verdict(1, torch.zeros(2, dtype=torch.long))], 0.03, 0.072,
                   setup_s=2.0)  # fmt: skip
    assert length.setup_s_per_token == pytest.approx(0.01)  # 2 s over 200 tokens
    # each draft saves a few ms a token: 2 s of catch-up pays back only over many tokens
    assert length.limits(["c"], [200], [16]) == [0]
    assert length.limits(["d"], [200], [100_000])[0] >= 1
    assert length.limits(["b"], [0], [60])[0] >= 1  # b is caught up (3 tokens ride along)
    assert length.limits(["c"], [220], [16]) == [0]  # still not worth it
    assert length.limits(["e"], [20], [16])[0] >= 1  # a prompt window's 20 tokens pay
    assert length._requests["c"].catch_up == 0  # declined: nothing to catch up on


class SlowSetup(LimitSpy):
    """A drafter that spends `SETUP_S` on one-time work in every propose, and says so."""

    SETUP_S = 0.2

    def propose(self, seqs, budgets):
        time.sleep(self.SETUP_S)
        self.setup_s = self.SETUP_S
        return super().propose(seqs, budgets)


def test_one_time_drafting_work_is_not_priced_per_draft_token(tiny_model_dir: Path) -> None:
    """A draft model prefilling a new prompt (`setup_s`) is paid once: the cost rule's
    drafting seconds per token leave it out (else one prefill would stop all drafting)."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "draft_length": "cost",
              "prompt_lookup_min": 1}  # fmt: skip
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    llm.engine.drafter = SlowSetup(llm.engine.drafter)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate({"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}, params)
    assert llm.engine.drafter.seen  # it drafted
    assert llm.engine.draft_length.draft_s_per_token < SlowSetup.SETUP_S / 8


def test_a_draft_model_reports_its_prompt_prefill_as_setup(other_draft_dir: Path) -> None:
    draft = load_model(other_draft_dir, dtype="float32")
    drafter = DraftModelDrafter(draft, 3, draft.config.vocab_size)
    seq = FakeSeq("a", [5, 17, 42, 99, 3, 250], params=GREEDY)
    (first,) = drafter.propose([seq], budgets([3]))
    assert drafter.setup_s > 0  # the prompt was prefilled alone
    seq.token_ids += [*first.tokens.tolist(), 7]
    drafter.commit(seq, Verdict(3, torch.tensor([*first.tokens.tolist(), 7])), NO_TARGET_OUTPUTS)
    drafter.propose([seq], budgets([3]))
    assert drafter.setup_s == 0  # caught up in the batched passes
