"""The drafter contract's typed seams: wrappers forward what the drafter they wrap needs and
spends, the engine hands each drafter exactly what it asked for, and greedy verification
never builds probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq

from specdecode.drafters.base import DrafterBase, DrafterNeeds, SeqView
from specdecode.drafters.mux import DrafterMux
from specdecode.drafters.overlap import OverlapDrafter
from specdecode.llm import LLM
from specdecode.sampling import decide as verifier
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


class Needy(DrafterBase):
    """Drafts last + 1, ...; asks for layer 1's states and the argmax, spends `SETUP_S` of
    one-time work in every propose (reading the whole sequence: `catch_up`), answers to a
    name and records the budgets of each propose and what each commit got."""

    SETUP_S = 0.25

    def __init__(self, layers: tuple[int, ...] = (1,)) -> None:
        self.needs = DrafterNeeds(hidden_layers=layers, target_argmax=True)
        self.names = ("needy",)
        self.seen: list[tuple[int, TargetOutputs]] = []
        self.budgets: list[list[DraftBudget]] = []  # per propose

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        self.setup_s = self.SETUP_S
        self.budgets.append(list(budgets))
        return [
            Draft(torch.arange(s.token_ids[-1] + 1, s.token_ids[-1] + 1 + b.max_tokens) % 300)
            for s, b in zip(seqs, budgets, strict=True)
        ]

    def catch_up(self, seq: SeqView) -> int:
        return len(seq.token_ids)

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        self.seen.append((len(seq.token_ids), target))


@pytest.mark.parametrize("wrap", ["overlap", "mux"])
def test_a_wrapped_drafter_reports_what_the_bare_one_does(wrap: str) -> None:
    """Needs, setup time and catch-up pass through a wrapper (SSD's overlap, the mux); a
    wrapper that dropped setup_s billed a draft model's prompt prefill as per-token drafting
    time, one that dropped catch_up hid it from the cost rule's pricing."""
    bare = Needy()
    wrapped = OverlapDrafter(bare, 3) if wrap == "overlap" else DrafterMux({"a": (bare, 3)})
    assert wrapped.needs == bare.needs
    seq = FakeSeq("r", [1, 2, 3], params=SamplingParams(temperature=0.0))
    assert wrapped.catch_up(seq) == bare.catch_up(seq) == 3
    wrapped.propose([seq], [DraftBudget(5, (0.25, 0.5))])  # the mux cuts it to its K, 3
    assert wrapped.setup_s == bare.setup_s == Needy.SETUP_S
    assert bare.budgets[0] == [DraftBudget(5 if wrap == "overlap" else 3, (0.25, 0.5))]
    target = TargetOutputs(argmax=(4, 5, 6, 7))
    wrapped.commit(seq, Verdict(3, torch.tensor([4, 5, 6, 7])), target)
    assert bare.seen == [(3, target)]
    if wrap == "overlap":
        assert wrapped.names == bare.names


def test_the_engine_hands_over_what_was_asked_and_nothing_else(tiny_model_dir: Path) -> None:
    """With hidden layers and the argmax asked for, every commit (the prefill's too) gets
    states of the tokens kept and one argmax per pass position; a drafter that asks for
    nothing gets neither."""
    needy = Needy((2,))
    llm = LLM(str(tiny_model_dir), dtype="float32", drafter=needy)
    (out,) = llm.generate(PROMPTS[0], GREEDY)
    prompt = len(PROMPTS[0]["prompt_token_ids"])
    first_length, first = needy.seen[0]
    assert first_length == prompt + 1  # the prefill's commit: the first token
    assert first.hidden is not None and first.hidden.start == 0
    assert len(first.hidden.hidden) == prompt and first.argmax is not None
    assert len(first.argmax) == 1 and first.argmax[0] == out.token_ids[0]
    for length, target in needy.seen[1:]:
        assert target.hidden is not None and target.argmax is not None
        assert target.hidden.start + len(target.hidden.hidden) == length - 1
        assert len(target.argmax) >= 1
    plain = Needy((2,))
    plain.needs = DrafterNeeds()
    LLM(str(tiny_model_dir), dtype="float32", drafter=plain).generate(PROMPTS[0], GREEDY)
    assert all(t.hidden is None and t.argmax is None for _, t in plain.seen)


def test_greedy_steps_build_no_probabilities(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An all-greedy batch is verified on token ids: p is never built (and the output is
    the one a plain run gives); a sampled row in the batch does build it, for itself."""
    config = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(str(tiny_model_dir), dtype="float32", speculative_config=config)
    plain = LLM(str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    built: list[int] = []
    real = verifier.probs_from_logits

    def counting(logits: torch.Tensor, st):  # [B, K + 1, V]
        built.append(logits.shape[0])
        return real(logits, st)

    monkeypatch.setattr(verifier, "probs_from_logits", counting)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert built == []
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=GREEDY.max_tokens)
    mixed = llm.generate(PROMPTS[:2], [GREEDY, sampled])
    assert mixed[0].token_ids == expected[0]
    assert built and set(built) == {1}  # only the sampled row's p
