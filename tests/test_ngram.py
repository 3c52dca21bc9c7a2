"""The n-gram (prompt lookup) drafter: hand-built sequences and a brute-force reference."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from spec_cases import budgets

from specdecode.drafters.ngram import NgramConfig, NgramDrafter
from specdecode.sampling_params import SamplingParams
from specdecode.types import NO_TARGET_OUTPUTS, Verdict

EOS = 99


@dataclass
class FakeSeq:
    """A minimal SeqView."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None


def _drafter(k: int = 4, lo: int = 1, hi: int = 3, eos: tuple[int, ...] = (EOS,)) -> NgramDrafter:
    return NgramDrafter(NgramConfig(k, prompt_lookup_max=hi, prompt_lookup_min=lo), eos)


def _propose(drafter: NgramDrafter, tokens: list[int], max_tokens: int = 100) -> list[int]:
    draft = drafter.propose([FakeSeq("r", tokens)], budgets([max_tokens]))[0]
    assert draft.probs is None
    assert draft.tokens.dtype == torch.long and draft.tokens.dim() == 1
    return draft.tokens.tolist()


def _reference(tokens: list[int], k: int, lo: int, hi: int, eos: set[int]) -> list[int]:
    """Brute force: scan backwards for the most recent earlier occurrence, longest n first."""
    length = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n > length or k == 0:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                out = tokens[start + n : start + n + k]
                cut = next((i for i, t in enumerate(out) if t in eos), len(out))
                return out[:cut]
    return []


def test_longest_match_preferred_over_shorter() -> None:
    # suffix (1, 2, 3): the 3-gram matches at 0 (-> 7), the 1-gram (3,) more recently at 6 (-> 8)
    tokens = [1, 2, 3, 7, 0, 0, 3, 8, 1, 2, 3]
    assert _propose(_drafter(k=1, lo=1, hi=3), tokens) == [7]
    assert _propose(_drafter(k=1, lo=1, hi=1), tokens) == [8]


def test_most_recent_occurrence_wins() -> None:
    tokens = [4, 5, 10, 11, 4, 5, 20, 21, 4, 5]
    assert _propose(_drafter(k=2, lo=2, hi=2), tokens) == [20, 21]


def test_overlapping_occurrence_uses_suffix_tokens() -> None:
    # (7, 7) last occurs at 1 (the suffix is at 2): its continuation is the final token
    assert _propose(_drafter(k=5, lo=2, hi=2), [7, 7, 7, 7]) == [7]


def test_truncated_by_max_tokens_k_and_history_end() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert _propose(_drafter(k=4, lo=2, hi=2), tokens) == [3, 4, 5, 6]
    assert _propose(_drafter(k=4, lo=2, hi=2), tokens, max_tokens=2) == [3, 4]
    assert _propose(_drafter(k=4, lo=2, hi=2), tokens, max_tokens=0) == []
    assert _propose(_drafter(k=10, lo=2, hi=2), tokens) == [3, 4, 5, 6, 7, 1, 2]


def test_no_match_gives_empty_draft() -> None:
    drafter = _drafter(lo=2, hi=3)
    assert _propose(drafter, [1, 2, 3, 4, 5]) == []
    draft = drafter.propose([FakeSeq("x", [])], budgets([4]))[0]
    assert draft.tokens.shape == (0,) and draft.tokens.dtype == torch.long
    assert _propose(_drafter(lo=1, hi=1), [1]) == []


def test_never_proposes_eos_or_beyond() -> None:
    tokens = [1, 2, 3, EOS, 5, 6, 1, 2]
    assert _propose(_drafter(k=5, lo=2, hi=2), tokens) == [3]
    tokens = [1, 2, EOS, 5, 1, 2]
    assert _propose(_drafter(k=5, lo=2, hi=2), tokens) == []
    assert _propose(_drafter(k=5, lo=2, hi=2, eos=(5, EOS)), [1, 2, 3, 5, 6, 1, 2]) == [3]


def test_batch_keeps_sequences_apart() -> None:
    drafter = _drafter(k=2, lo=1, hi=2)
    seqs = [FakeSeq("a", [1, 2, 3, 1]), FakeSeq("b", [1, 9, 8, 1])]
    drafts = drafter.propose(seqs, budgets([2, 1]))
    assert [d.tokens.tolist() for d in drafts] == [[2, 3], [9]]
    with pytest.raises(ValueError, match="one entry per sequence"):
        drafter.propose(seqs, budgets([2]))
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        drafter.propose(seqs[:1], budgets([-1]))


def test_incremental_commits_match_fresh_drafter_and_reference() -> None:
    rng = random.Random(0)
    for trial in range(150):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        k = rng.randint(1, 6)
        drafter = _drafter(k=k, lo=lo, hi=hi, eos=(0,))
        seq = FakeSeq(f"r{trial}", [rng.randrange(4) for _ in range(rng.randint(0, 12))])
        for _ in range(rng.randint(1, 15)):
            max_tokens = rng.randint(0, 7)
            got = drafter.propose([seq], budgets([max_tokens]))[0].tokens.tolist()
            fresh = _drafter(k=k, lo=lo, hi=hi, eos=(0,))
            assert fresh.propose([seq], budgets([max_tokens]))[0].tokens.tolist() == got
            assert got == _reference(seq.token_ids, min(k, max_tokens), lo, hi, {0})
            new = [rng.randrange(4) for _ in range(rng.randint(1, k + 1))]
            seq.token_ids.extend(new)
            drafter.commit(seq, Verdict(len(new) - 1, torch.tensor(new)), NO_TARGET_OUTPUTS)


def test_release_forgets_the_sequence() -> None:
    drafter = _drafter(k=1, lo=1, hi=1)
    assert _propose(drafter, [1, 2, 1]) == [2]
    drafter.release("r")
    drafter.release("never-seen")
    # the same id now names a new sequence: nothing of the old history may leak in
    assert _propose(drafter, [1, 5]) == []
    assert _propose(drafter, [1, 5, 1]) == [5]


def test_rolled_back_history_is_reindexed() -> None:
    drafter = _drafter(k=1, lo=1, hi=1)
    assert _propose(drafter, [1, 2, 3, 4, 1]) == [2]
    assert _propose(drafter, [3, 1]) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an int in 1\.\.64"),
        ({"prompt_lookup_max": 0}, "1 <= prompt_lookup_min <= prompt_lookup_max"),
        ({"prompt_lookup_min": -1}, "1 <= prompt_lookup_min <= prompt_lookup_max"),
        ({"prompt_lookup_min": 1.5}, "1 <= prompt_lookup_min <= prompt_lookup_max"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "got 4 and 2"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    base = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match=message):
        NgramConfig(**(base | kwargs))


def test_tokens_tree_merges_branches_into_a_trie() -> None:
    from specdecode.drafters.ngram import tokens_tree

    tokens, tree = tokens_tree([[5, 6, 7], [5, 8], [9]], 4)
    assert tokens == [5, 6, 7, 8] and tree.parents == (-1, 0, 1, 0)
    tokens, tree = tokens_tree([[5, 6, 7], [5, 8], [9]], 10)
    assert tokens == [5, 6, 7, 8, 9] and tree.parents == (-1, 0, 1, 0, -1)


def test_tree_width_drafts_several_continuations() -> None:
    # suffix (1, 2) occurred with continuations 9 6 (latest), 8 5 and 7 1
    tokens = [1, 2, 7, 1, 2, 8, 5, 1, 2, 9, 6, 3, 1, 2]
    config = NgramConfig(8, prompt_lookup_max=2, prompt_lookup_min=2, tree_width=3, tree_depth=2)
    draft = NgramDrafter(config, (EOS,)).propose([FakeSeq("r", tokens)], budgets([8]))[0]
    assert draft.tokens.tolist() == [9, 6, 8, 5, 7, 1]
    assert draft.tree.parents == (-1, 0, -1, 2, -1, 4) and draft.probs is None
    narrow = NgramDrafter(NgramConfig(3, 2, 2, tree_width=3), (EOS,))
    assert narrow.propose([FakeSeq("r", tokens)], budgets([8]))[0].tokens.tolist() == [9, 6, 3]


def test_tree_width_one_is_the_chain() -> None:
    random.seed(0)
    for _ in range(50):
        tokens = [random.randrange(4) for _ in range(30)]
        chain = _drafter(k=4, lo=1, hi=3)
        tree = NgramDrafter(NgramConfig(4, 3, 1, tree_width=1), (EOS,))
        assert _propose(chain, tokens) == _propose(tree, tokens)
