"""Speculative-speculative decoding (the overlap drafter): prepared drafts are used exactly when
the hypothesis comes true, and the output is identical with and without the overlap."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq, budgets

from specdecode.drafters.base import DrafterBase, SeqView
from specdecode.drafters.overlap import OverlapDrafter
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.types import NO_TARGET_OUTPUTS, Draft, DraftBudget, Verdict


class Counter(DrafterBase):
    """Drafts last + 1, last + 2, ...; records the contexts it drafted after."""

    def __init__(self) -> None:
        self.contexts: list[list[int]] = []

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        drafts = []
        for seq, limit in zip(seqs, [b.max_tokens for b in budgets], strict=True):
            self.contexts.append(list(seq.token_ids))
            last = seq.token_ids[-1]
            drafts.append(Draft(torch.arange(last + 1, last + 1 + min(limit, 4))))
        return drafts


def test_a_prepared_draft_is_used_only_when_the_hypothesis_comes_true() -> None:
    inner = Counter()
    drafter = OverlapDrafter(inner, 3)
    seq = FakeSeq("r", [1, 2], 1, SamplingParams(temperature=0.0))
    assert drafter.propose([seq], budgets([3]))[0].tokens.tolist() == [3, 4, 5]
    seq.token_ids += [3, 4, 5, 6]  # all accepted + the bonus the drafter predicted (6)
    drafter.commit(seq, Verdict(3, torch.tensor([3, 4, 5, 6])), NO_TARGET_OUTPUTS)
    assert inner.contexts == [[1, 2], [1, 2, 3, 4, 5]]  # the real draft, then the prepared one
    assert drafter.propose([seq], budgets([2]))[0].tokens.tolist() == [7, 8]  # prepared, cut to 2
    assert drafter.num_hits == 1
    seq.token_ids += [7, 0]  # the bonus differs from the prediction
    drafter.commit(seq, Verdict(1, torch.tensor([7, 0])), NO_TARGET_OUTPUTS)
    assert drafter.propose([seq], budgets([3]))[0].tokens.tolist() == [1, 2, 3]  # drafted afresh
    drafter._wait()  # (the next step's preparation drafted after the fresh draft)
    assert drafter.num_hits == 1 and inner.contexts[-2] == seq.token_ids
    drafter.release("r")
    assert not drafter._prepared


def test_sampled_sequences_are_not_prepared() -> None:
    inner = Counter()
    drafter = OverlapDrafter(inner, 3)
    seq = FakeSeq("r", [1, 2], 1, SamplingParams(temperature=0.8))
    drafter.propose([seq], budgets([3]))
    drafter.commit(seq, Verdict(0, torch.tensor([9])), NO_TARGET_OUTPUTS)
    assert inner.contexts == [[1, 2]] and drafter.num_prepared == 0


def test_greedy_output_is_identical_with_and_without_the_overlap(tiny_model_dir: Path) -> None:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    config = {
        "model": str(tiny_model_dir),
        "num_speculative_tokens": 3,
        "ssd": True,
        "draft_length": "fixed",
    }
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert [o.token_ids for o in llm.generate(PROMPTS[1], GREEDY)] == expected[1:2]
    assert llm.engine.drafter.num_hits > 0  # the target drafting itself: every guess is right
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True)
    first, second = llm.generate(PROMPTS, params), llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tree_width": 2}, "ssd prepares chains"),
        ({"num_speculative_tokens": 64}, r"ssd needs num_speculative_tokens <= 63"),
    ],
)
def test_bad_ssd_configs_are_refused(tiny_model_dir: Path, extra: dict, message: str) -> None:
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 3, "ssd": True, **extra}
    with pytest.raises(UserError, match=message):
        LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
