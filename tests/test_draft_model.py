"""Draft-model drafter: lossless greedy output, full acceptance of itself, seeded sampling, a
prompt window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq, PassCounter, assert_fully_accepted, budgets

from specdecode.drafters.base import DrafterBase, DrafterNeeds
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.registry import parse_speculative_config
from specdecode.drafters.window import PromptWindow, WindowedSeq
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.types import NO_TARGET_OUTPUTS, Draft, Verdict


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
            out += _drafts(own.propose([seq], budgets([limit])))
        for seq in seqs:
            seq.generator = torch.Generator().manual_seed(int(seq.request_id[1:]))
        return out

    expected = alone([3, 3, 3, 3])
    drafts = drafter.propose(seqs, budgets([3, 3, 3, 3]))
    assert _drafts(drafts) == expected
    assert counter.passes == 3 + 3  # three prompts of > 1 token prefilled alone, then K passes
    for seq, d in zip(seqs, drafts, strict=True):  # accept the first token, then the target's 7
        seq.token_ids += [int(d.tokens[0]), 7]
        drafter.commit(seq, Verdict(1, torch.tensor([int(d.tokens[0]), 7])), NO_TARGET_OUTPUTS)
    counter.passes = 0
    expected = alone([3, 0, 1, 2])
    drafts = drafter.propose(seqs, budgets([3, 0, 1, 2]))
    assert _drafts(drafts) == expected
    assert [len(d) for d in expected] == [3, 0, 1, 2]
    assert counter.passes == 3  # the catch-up rides in the first pass; rows stop at their limit
    drafter.release("s1")
    drafter.release("unknown")
    drafter.propose(seqs[2:], budgets([1, 1]))
    assert len(drafter._caches) == 3 and "s1" not in drafter._caches


def test_catch_up_counts_what_a_propose_would_feed_alone(other_draft_dir: Path) -> None:
    """A new prompt is read alone (its whole length), a backlog of at most K + 1 tokens rides
    with the first draft pass (0), a longer one is read alone; a prompt window reads at most
    its window and what followed it; `setup_s` times the reading alone."""
    draft = load_model(other_draft_dir, dtype="float32")
    drafter = DraftModelDrafter(draft, 3, draft.config.vocab_size)
    seq = FakeSeq("a", list(range(1, 41)))
    assert drafter.catch_up(seq) == 40 and drafter.catch_up(FakeSeq("one", [5])) == 0
    (first,) = drafter.propose([seq], budgets([3]))
    assert drafter.setup_s > 0

    def step(new: list[int], accepted: int) -> None:
        seq.token_ids += new
        drafter.commit(seq, Verdict(accepted, torch.tensor(new)), NO_TARGET_OUTPUTS)

    step([int(first.tokens[0]), 7], 1)  # its first token accepted, then the target's 7
    assert drafter.catch_up(seq) == 0  # only 7 is missing: it rides with the first pass
    drafter.propose([seq], budgets([3]))
    assert drafter.setup_s == 0.0
    step([8], 0)
    for token in range(10, 20):  # 10 steps without a draft
        step([token], 0)
    assert drafter.catch_up(seq) == 11  # 8 and 10 .. 19: read alone
    window = PromptWindow(DraftModelDrafter(draft, 3, draft.config.vocab_size), 6)
    fresh = FakeSeq("b", list(range(1, 41)))
    assert window.catch_up(fresh) == 6 and not window._offsets  # asking fixes nothing
    window.commit(fresh, Verdict(0, torch.tensor([40])), NO_TARGET_OUTPUTS)
    fresh.token_ids += [3, 4]
    assert window.catch_up(fresh) == 8  # the window, then what followed it


def test_a_tree_times_its_prompt_as_setup_not_as_drafting(other_draft_dir: Path) -> None:
    """A tree's first pass reads a new prompt as a chain's catch-up does: `catch_up` counts it
    and `setup_s` times it, so the cost rule does not take the prompt's prefill for the price
    of drafting (it did: one 108 ms "draft token" for the 0.5B, after which no tree paid);
    later steps, their backlog riding with the first pass, report no setup."""
    draft = load_model(other_draft_dir, dtype="float32")
    drafter = DraftModelDrafter(draft, 4, draft.config.vocab_size, tree_width=2, tree_depth=2)
    seq = FakeSeq("t", list(range(1, 41)))
    assert drafter.catch_up(seq) == 40
    (first,) = drafter.propose([seq], budgets([4]))
    assert first.tree is not None and drafter.setup_s > 0
    seq.token_ids += [int(first.tokens[0]), 7]
    drafter.commit(seq, Verdict(1, torch.tensor([int(first.tokens[0]), 7])), NO_TARGET_OUTPUTS)
    assert drafter.catch_up(seq) == 0
    drafter.propose([seq], budgets([4]))
    assert drafter.setup_s == 0.0


class FedTokens:
    """Records how many tokens each of a model's passes feeds per row (everything else is the
    model's)."""

    def __init__(self, model) -> None:
        self.model, self.widths = model, []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, tokens, *args, **kwargs):
        self.widths.append(tokens.shape[1])
        return self.model(tokens, *args, **kwargs)


@pytest.mark.parametrize("width", [1, 2])
def test_a_prompt_window_keeps_the_output_and_bounds_the_prefill(
    tiny_model_dir: Path, other_draft_dir: Path, expected: list[list[int]], width: int
) -> None:
    """With prompt_window 6 the draft model prefills the 40-token prompt's last 6 tokens (with
    the first generated one) instead of all 41, chains and trees, batched and alone; greedy
    output is plain decoding's."""
    config = {"model": str(other_draft_dir), "num_speculative_tokens": 3, "prompt_window": 6,
              "draft_length": "fixed", "tree_width": width}  # fmt: skip
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    window = llm.engine.drafter
    assert isinstance(window, PromptWindow) and window.tokens == 6
    fed = window.inner.model = FedTokens(window.inner.model)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0
    assert max(fed.widths) == 6  # the 40-token prompt's windowed prefill; nothing longer
    fed.widths.clear()
    assert list(llm.generate(PROMPTS[1], GREEDY)[0].token_ids) == expected[1]
    assert fed.widths[0] == 6
    assert not window._offsets  # released with the sequences


class Recorder(DrafterBase):
    """Drafts nothing; records the tokens of every sequence it is handed."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def propose(self, seqs, budgets):
        self.seen += [list(s.token_ids) for s in seqs]
        return [Draft(torch.zeros(0, dtype=torch.long)) for _ in seqs]

    def commit(self, seq, verdict, target) -> None:
        self.seen.append(list(seq.token_ids))


def test_a_window_is_fixed_when_the_sequence_is_first_seen() -> None:
    inner = Recorder()
    window = PromptWindow(inner, 3)
    seq = FakeSeq("r", [1, 2, 3, 4, 5], num_prompt_tokens=4)
    window.commit(seq, Verdict(0, torch.tensor([5])), NO_TARGET_OUTPUTS)
    seq.token_ids += [6, 7]
    window.propose([seq, FakeSeq("short", [9, 8])], budgets([2, 2]))
    assert inner.seen == [[3, 4, 5], [3, 4, 5, 6, 7], [9, 8]]  # from offset 2 on, as it grows
    assert WindowedSeq(seq, 2).num_prompt_tokens == 2
    window.release("r")
    window.propose([seq], budgets([1]))  # a new sequence under a released id: a new window
    assert inner.seen[-1] == [5, 6, 7]


def test_prompt_window_refuses_what_it_cannot_window() -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        PromptWindow(Recorder(), 0)
    needy = Recorder()
    needy.needs = DrafterNeeds(target_argmax=True)
    with pytest.raises(ValueError, match="need nothing from the target"):
        PromptWindow(needy, 8)
    for bad in (0, -2, 2.5, True, "64"):
        with pytest.raises(UserError, match=r"prompt_window must be None \(the whole prompt\)"):
            parse_speculative_config({"model": "m", "num_speculative_tokens": 3,
                                      "prompt_window": bad})  # fmt: skip
