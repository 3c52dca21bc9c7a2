"""Checks every trained-head drafter shares: the reduced vocabulary, exact sampling (with a
biased verifier that must fail), and head folders edited to be wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS
from train_cases import chat_prompts, examples

from specdecode.certify import CertifyConfig, certify
from specdecode.llm import LLM
from specdecode.sampling import decide as verifier
from specdecode.sampling.rejection import verify_chain
from specdecode.sampling_params import SamplingParams


def record_drafts(llm: LLM) -> list:
    """Wrap the drafter's propose so that every draft it returns is also appended to the list
    returned here."""
    drafter, seen = llm.engine.drafter, []
    original = drafter.propose

    def spy(seqs, max_tokens):
        drafts = original(seqs, max_tokens)
        seen.extend(drafts)
        return drafts

    drafter.propose = spy
    return seen


def check_greedy_and_sampled_in_one_batch(
    llm: LLM, vocab_size: int, greedy: SamplingParams, expected: list[int]
) -> None:
    """A greedy and a sampled request drafted in one batch: the greedy one's chains come as
    bare tokens (probs None: the head's argmax, a one-hot q) and its output is plain greedy
    decoding's (`expected`); the sampled one's carry the q [k, vocab_size] they came from."""
    drafter, seen = llm.engine.drafter, []
    original = drafter.propose

    def spy(seqs, max_tokens):
        drafts = original(seqs, max_tokens)
        seen.extend((seq.params.greedy, d) for seq, d in zip(seqs, drafts, strict=True))
        return drafts

    drafter.propose = spy
    sampled = SamplingParams(temperature=0.8, max_tokens=greedy.max_tokens, seed=5, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], [greedy, sampled])
    assert list(outs[0].token_ids) == expected
    drafted = [(is_greedy, d) for is_greedy, d in seen if len(d.tokens)]
    assert {is_greedy for is_greedy, _ in drafted} == {True, False}
    for is_greedy, draft in drafted:
        want = None if is_greedy else (len(draft.tokens), vocab_size)
        assert (None if draft.probs is None else tuple(draft.probs.shape)) == want


def check_reduced_vocabulary(
    llm: LLM, draft_to_target: torch.Tensor, expected: list[list[int]]
) -> None:
    """Sampled drafts and their q only cover the head's tokens (`draft_to_target`), while the
    target's greedy output (`expected`) uses tokens outside them."""
    allowed = set(draft_to_target.tolist())
    seen = record_drafts(llm)
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=3, ignore_eos=True)
    llm.generate(PROMPTS, params)
    assert seen and all(set(d.tokens.tolist()) <= allowed for d in seen)
    outside = torch.ones(300, dtype=torch.bool)
    outside[list(allowed)] = False
    assert all(float(d.probs[:, outside].sum()) == 0.0 for d in seen if d.probs is not None)
    assert any(t not in allowed for want in expected for t in want)


def check_certify(llm: LLM, model_dir: Path, monkeypatch: pytest.MonkeyPatch, biased: bool) -> None:
    """`certify`'s chi-square test over whole continuations passes; with `biased`, a verifier
    that treats q as one-hot fails it."""
    if biased:

        def one_hot_q(target_probs, draft_tokens, draft_probs, *args, **kwargs):
            if draft_probs is not None:
                draft_probs = draft_probs.scatter(-1, draft_tokens[..., None], 1.0)
            return verify_chain(target_probs, draft_tokens, draft_probs, *args, **kwargs)

        monkeypatch.setattr(verifier, "verify_chain", one_hot_q)
    prompt = tuple(chat_prompts(model_dir, examples(1, 5000))[0]["prompt_token_ids"])
    result = certify(llm, CertifyConfig(prompt, top_k=4, num_samples=3000, seed=1))
    print(result.as_dict())
    assert result.num_draft_tokens > 1000 and 0.05 < result.acceptance_rate < 0.95
    assert result.passed is not biased
    if biased:
        assert result.p_value < 1e-6


def sampled_runs(model_dir: Path, drafters: list[object]) -> list[list[tuple]]:
    """Per drafter, (tokens, accepted draft tokens) of each of three held-out prompts sampled
    with a seed: equal lists mean the drafters draft alike."""
    prompts = chat_prompts(model_dir, examples(3, 3000))
    params = SamplingParams(temperature=0.7, max_tokens=24, seed=4, ignore_eos=True)
    results = []
    for drafter in drafters:
        outs = LLM(str(model_dir), dtype="float32", drafter=drafter).generate(prompts, params)
        results.append([(o.token_ids, o.metrics.spec.num_accepted_tokens) for o in outs])
    return results


def edited_head(head: Path, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the head folder `head` whose config.json went through `edit`."""
    out = tmp_path / "edited"
    out.mkdir()
    cfg = json.loads((head / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes())
    return out


def check_greedy_equals_plain(llm: LLM, expected: list[list[int]]) -> None:
    """Greedy output equals plain decoding's (`expected`, for PROMPTS) batched and alone, some
    tokens were drafted, and finished requests released the head's caches."""
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0
    assert not llm.engine.drafter._rows


def passes_per_propose(drafter: object, pass_name: str) -> list[tuple[int, int]]:
    """Count the drafter's passes: wrap `drafter.head.<pass_name>` and `drafter.propose`; the
    returned list fills with, per propose, (passes run, requests with a draft budget)."""
    head, passes, per_propose = drafter.head, [], []
    run = getattr(head, pass_name)

    def counted(*args: object, **kw: object) -> object:
        passes.append(1)
        return run(*args, **kw)

    setattr(head, pass_name, counted)
    original = drafter.propose

    def propose(seqs: object, budgets: list) -> object:
        before = len(passes)
        drafts = original(seqs, budgets)
        per_propose.append((len(passes) - before, sum(1 for b in budgets if b.max_tokens > 0)))
        return drafts

    drafter.propose = propose
    return per_propose


def check_plan_prices(model_dir: Path, prompts: Path, spec: dict, max_k: int) -> None:
    """`specdecode plan` replays the drafter of `spec` (its chains K = 1..max_k and its trees)
    on the target's greedy text, its drafting time measured, and picks the best."""
    from specdecode.bench.plan import PlanConfig, run_plan

    config = PlanConfig(
        str(model_dir),
        spec,
        context=16,
        max_k=max_k,
        dtype="float32",
        prompt_sets=(str(prompts),),
        max_tokens=8,
        repeats=1,
    )
    plan = run_plan(config)
    chains = [r["k"] for r in plan["rows"] if r["tree_width"] == 1]
    assert chains == list(range(1, max_k + 1))
    assert all(r["draft_ms_per_step"] > 0 for r in plan["rows"])
    assert plan["best"] == max(plan["rows"], key=lambda r: r["predicted_speedup"])


def acceptance_rates(
    llms: list[LLM], prompts: list, params: SamplingParams, plain: list | None = None
) -> list[float]:
    """Per engine, the share of its drafted tokens accepted over `prompts`; with `plain`
    (token ids per prompt), each engine's output checked equal to plain decoding's."""
    rates = []
    for llm in llms:
        outs = llm.generate(prompts, params)
        if plain is not None:
            assert [o.token_ids for o in outs] == plain
        drafted = sum(o.metrics.spec.num_draft_tokens for o in outs)
        rates.append(sum(o.metrics.spec.num_accepted_tokens for o in outs) / drafted)
    return rates
