"""Draft-model drafter: lossless greedy output, full acceptance of itself, seeded sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq, PassCounter, assert_fully_accepted

from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.types import NO_TARGET_OUTPUTS, Verdict


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _speculative(target_dir: Path, draft_dir: Path, k: int) -> LLM:
    """The target with a `DraftModelDrafter` over the model in `draft_dir`."""
    draft = load_model(draft_dir, dtype="float32")
    drafter = DraftModelDrafter(draft, k, draft.config.vocab_size)
    return LLM(model=str(target_dir), dtype="float32", drafter=drafter)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_with_another_draft_model_equals_plain(
    tiny_model_dir: Path, other_draft_dir: Path, expected: list[list[int]], k: int
) -> None:
    llm = _speculative(tiny_model_dir, other_draft_dir, k)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0  # it really drafted


@pytest.mark.parametrize("k", [1, 3, 8])
def test_target_as_its_own_draft_is_fully_accepted(
    tiny_model_dir: Path, expected: list[list[int]], k: int
) -> None:
    llm = _speculative(tiny_model_dir, tiny_model_dir, k)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert_fully_accepted(outs, k)
    assert not llm.engine.drafter._caches  # finished sequences released their caches


def test_seeded_sampling_is_reproducible(tiny_model_dir: Path, other_draft_dir: Path) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=3, ignore_eos=True)
    llm = _speculative(tiny_model_dir, other_draft_dir, 4)
    first = [list(o.token_ids) for o in llm.generate(PROMPTS, params)]
    second = [list(o.token_ids) for o in llm.generate(PROMPTS, params)]
    fresh = _speculative(tiny_model_dir, other_draft_dir, 4)
    assert first == second == [list(o.token_ids) for o in fresh.generate(PROMPTS, params)]
    assert all(len(tokens) == 30 for tokens in first)


def test_self_draft_sampling_accepts_everything(tiny_model_dir: Path) -> None:
    """q == p exactly when the draft is the target, so sampled drafts are always accepted."""
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=7, ignore_eos=True)
    llm = _speculative(tiny_model_dir, tiny_model_dir, 3)
    for out in llm.generate(PROMPTS, params):
        assert out.metrics.spec.acceptance_rate >= 0.98


def test_vocabulary_mismatch_is_a_clear_error(tiny_model_dir: Path) -> None:
    draft = load_model(tiny_model_dir, dtype="float32")
    with pytest.raises(ValueError, match="draft model has 300 tokens, target has 512"):
        DraftModelDrafter(draft, 3, 512)


@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_bad_draft_length_is_a_clear_error(tiny_model_dir: Path, k: object) -> None:
    draft = load_model(tiny_model_dir, dtype="float32")
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an int in 1\.\.64"):
        DraftModelDrafter(draft, k, 300)  # type: ignore[arg-type]


def _drafts(drafts) -> list[list[int]]:
    return [d.tokens.tolist() for d in drafts]


def test_chains_of_many_sequences_share_each_draft_pass(other_draft_dir: Path) -> None:
    """Every draft position is one pass over all sequences (not one per sequence), and each
    sequence's draft is the one it gets alone, greedy or seeded."""
    draft = load_model(other_draft_dir, dtype="float32")
    vocab = draft.config.vocab_size
    counter = PassCounter(draft)
    drafter = DraftModelDrafter(counter, 3, vocab)
    sampled = SamplingParams(temperature=0.9, max_tokens=40)
    seqs = [
        FakeSeq(f"s{i}", list(p["prompt_token_ids"]), params=GREEDY if i % 2 else sampled)
        for i, p in enumerate(PROMPTS)
    ]

    def alone(limits: list[int]) -> list[list[int]]:
        """Each sequence drafted by a fresh drafter of its own, with a fresh seeded generator."""
        out = []
        for seq, limit in zip(seqs, limits, strict=True):
            seq.generator = torch.Generator().manual_seed(int(seq.request_id[1:]))
            own = DraftModelDrafter(draft, 3, vocab)
            out += _drafts(own.propose([seq], [limit]))
        for seq in seqs:
            seq.generator = torch.Generator().manual_seed(int(seq.request_id[1:]))
        return out

    expected = alone([3, 3, 3, 3])
    drafts = drafter.propose(seqs, [3, 3, 3, 3])
    assert _drafts(drafts) == expected
    assert counter.passes == 3 + 3  # three prompts of > 1 token prefilled alone, then K passes
    for seq, d in zip(seqs, drafts, strict=True):  # accept the first token, then the target's 7
        seq.token_ids += [int(d.tokens[0]), 7]
        drafter.commit(seq, Verdict(1, torch.tensor([int(d.tokens[0]), 7])), NO_TARGET_OUTPUTS)
    counter.passes = 0
    expected = alone([3, 0, 1, 2])
    drafts = drafter.propose(seqs, [3, 0, 1, 2])
    assert _drafts(drafts) == expected
    assert [len(d) for d in expected] == [3, 0, 1, 2]
    assert counter.passes == 3  # the catch-up rides in the first pass; rows stop at their limit
    drafter.release("s1")
    drafter.release("unknown")
    drafter.propose(seqs[2:], [1, 1])
    assert len(drafter._caches) == 3 and "s1" not in drafter._caches
