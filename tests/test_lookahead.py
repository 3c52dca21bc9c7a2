"""Lookahead decoding: the window's tree (the docstring example), advancing on the target's
argmax and pooling n-grams, the node budget, and losslessness through the engine (greedy
equality, certify with a biased verifier that fails)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq, budgets
from test_certify import always_accept

from specdecode.certify import CertifyConfig, certify
from specdecode.drafters.lookahead import LookaheadConfig, LookaheadDrafter
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling import decide as verifier
from specdecode.sampling import tree as tree_verifier
from specdecode.tree.token_tree import ROOT
from specdecode.types import TargetOutputs, Verdict

EOS = 99


def _drafter(w: int = 2, n: int = 3, g: int = 2) -> LookaheadDrafter:
    config = LookaheadConfig(window_size=w, ngram_size=n, guess_set_size=g)
    return LookaheadDrafter(config, (EOS,))


def test_the_docstring_example() -> None:
    drafter = _drafter()
    seq = FakeSeq("r", [7, 8, 9])
    drafter.propose([seq], budgets([64]))
    window = drafter._windows["r"]
    window.levels = [[11, 12], [21, 22]]  # a1 a2 / b2 b3
    window.pool.clear()
    seq.token_ids = [7, 8, 9, 9]  # the last token has no pooled n-gram... yet
    draft = drafter.propose([seq], budgets([64]))[0]
    assert draft.tokens.tolist() == [11, 12, 21, 22]
    assert draft.tree is not None and draft.tree.parents == (ROOT, 0, 0, 1)  # b2 < a1, b3 < a2
    # the target predicts c3 = 31 after b2 (node 2) and c4 = 32 after b3 (node 3); rejects a1
    seq.token_ids.append(5)
    drafter.commit(seq, Verdict(0, torch.tensor([5])), TargetOutputs(argmax=(5, 6, 7, 31, 32)))
    assert window.levels == [[21, 22], [31, 32]]
    assert (21, 31) in window.pool[11] and (22, 32) in window.pool[12]


def test_guesses_start_with_the_last_token_and_fill_the_budget_before_the_window() -> None:
    drafter = _drafter(w=2, n=3, g=2)  # window 4 nodes, K = 2 x (2 + 2) = 8
    seq = FakeSeq("r", [1, 2, 3, 1, 4, 5, 1])  # committed n-grams after 1: (2, 3), (4, 5)
    draft = drafter.propose([seq], budgets([64]))[0]
    tokens, parents = draft.tokens.tolist(), draft.tree.parents
    assert tokens[:4] == [4, 5, 2, 3] and parents[:4] == (ROOT, 0, ROOT, 2)  # newest first
    assert len(tokens) <= 8
    only_guesses = drafter.propose([seq], budgets([3]))[0]  # no room for the window: it waits
    assert only_guesses.tokens.tolist() == [4, 5] and drafter._windows["r"].nodes is None


def test_n_grams_with_eos_are_not_pooled_and_the_pool_keeps_g_per_token() -> None:
    drafter = _drafter(g=2)
    seq = FakeSeq("r", [1, 2, 3, 1, EOS, 3, 1, 4, 4, 1, 5, 5, 1, 6, 6, 1])
    drafter.propose([seq], budgets([64]))
    assert list(drafter._windows["r"].pool[1]) == [(5, 5), (6, 6)]
    drafter.release("r")
    drafter.release("unknown")
    assert not drafter._windows


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ngram_size": 1}, r"ngram_size \(N\) >= 2"),
        ({"window_size": 0}, r"window_size \(W\) >= 1"),
        ({"window_size": 20, "ngram_size": 4}, r"\(N - 1\) x \(W \+ G\) = 72\), must be"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        LookaheadConfig(**kwargs)


def test_greedy_output_equals_plain_decoding(tiny_model_dir: Path) -> None:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    config = {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert [o.token_ids for o in llm.generate(PROMPTS[1], GREEDY)] == expected[1:2]
    assert llm.spec_metrics.num_accepted_tokens > 0 and not llm.engine.drafter._windows


def test_other_drafters_get_no_target_argmax(tiny_model_dir: Path) -> None:
    config = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    seen = []
    inner = llm.engine.drafter.commit
    llm.engine.drafter.commit = lambda seq, verdict, target: (
        seen.append(target.argmax),
        inner(seq, verdict, target),
    )
    llm.generate(PROMPTS[0], GREEDY)
    assert seen and all(a is None for a in seen)


@pytest.mark.parametrize("biased", [False, True])
def test_certify_passes_and_a_biased_verifier_fails(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    if biased:  # a chain keeps every draft token; a tree forgets the rejected siblings
        monkeypatch.setattr(verifier, "verify_chain", always_accept)
        monkeypatch.setattr(tree_verifier, "_residual", lambda r, x, q: r)
    config = {"method": "lookahead", "window_size": 2, "ngram_size": 2, "guess_set_size": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    prompt = (5, 17, 42, 5, 17, 42, 5, 17)
    result = certify(llm, CertifyConfig(prompt, num_tokens=4, top_k=4, num_samples=4000, seed=3))
    print(result.as_dict())
    assert result.num_draft_tokens > 1000
    assert result.passed is not biased
