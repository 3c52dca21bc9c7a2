"""Suffix decoding: the bounded-depth suffix trie (insertion, incremental growth, eviction,
matching, scoring), the drafter (own and global tries, EOS, limits, config), and losslessness
through the engine (greedy equality, certify with a biased verifier that fails)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, FakeSeq, budgets
from test_certify import always_accept

from specdecode.certify import CertifyConfig, certify
from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
from specdecode.drafters.suffix_tree import Cursor, Node, SuffixTree, best_candidate, grow, match
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling import decide as verifier
from specdecode.tree.token_tree import ROOT
from specdecode.types import NO_TARGET_OUTPUTS, Verdict

EOS = 99


def paths(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every path of the trie -> its count."""
    out: dict[tuple[int, ...], int] = {}

    def walk(node: Node, path: tuple[int, ...]) -> None:
        for token, child in node.children.items():
            out[(*path, token)] = child.count
            walk(child, (*path, token))

    walk(tree.root, ())
    return out


def reference_paths(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Brute force: occurrences of every substring of at most `depth` tokens."""
    out: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                key = tuple(seq[start:end])
                out[key] = out.get(key, 0) + 1
    return out


def test_the_docstring_example() -> None:
    tree = SuffixTree(3)
    tree.add([5, 6, 5, 6])
    assert paths(tree) == {
        (5,): 2, (5, 6): 2, (5, 6, 5): 1, (6,): 2, (6, 5): 1, (6, 5, 6): 1,
    }  # fmt: skip
    assert tree.num_nodes == 6


def test_add_extend_and_remove_agree_with_brute_force() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    tree = SuffixTree(5)
    for seq in seqs:
        tree.add(seq)
    assert paths(tree) == reference_paths(seqs, 5)
    grown = SuffixTree(5)
    for seq in seqs:  # one token at a time, as a request's own trie grows
        opened: list[Node] = []
        for token in seq:
            opened = grown.extend(opened, token)
            assert len(opened) <= 4
    assert paths(grown) == paths(tree) and grown.num_nodes == tree.num_nodes
    for gone in (seqs[0], seqs[3]):
        tree.remove(gone)
    rest = [s for i, s in enumerate(seqs) if i not in (0, 3)]
    assert paths(tree) == reference_paths(rest, 5)
    assert tree.num_nodes == len(paths(tree))


def test_cursor_follows_a_growing_context_and_rematches_after_a_change() -> None:
    rng = random.Random(1)
    tree = SuffixTree(6)
    tree.add([rng.randrange(3) for _ in range(40)])
    context: list[int] = []
    cursor = Cursor()
    for step_ in range(60):
        context.append(rng.randrange(3))
        cursor.follow(tree, context, 1)
        assert [id(n) for n in cursor.nodes] == [id(n) for n in match(tree, context)]
        if step_ == 30:
            tree.add([rng.randrange(3) for _ in range(20)])  # the cursor must re-match
    assert len(cursor.nodes) == 5  # every suffix of 1..depth - 1 tokens occurs


def test_grow_follows_frequencies_best_first() -> None:
    tree = SuffixTree(4)
    for seq in ([1, 7, 9], [1, 7, 9], [1, 7, 4], [1, 8]):
        tree.add(seq)
    node = tree.root.children[1]  # children 7 (3), 8 (1); under 7: 9 (2), 4 (1)
    chain = grow(node, 5, 0.0, 1, (), 1)
    assert chain.tokens == (7, 9) and chain.parents == (ROOT, 0)
    assert chain.score == pytest.approx(0.75 + 0.5)
    tree_ = grow(node, 3, 0.0, 2, (), 1)
    assert tree_.tokens == (7, 9, 8) and tree_.parents == (ROOT, 0, ROOT)
    assert grow(node, 5, 0.3, 2, (), 1).tokens == (7, 9)  # 8 (0.25), 7 4 (0.25) too unlikely
    assert grow(node, 5, 0.0, 1, {7}, 1).tokens == (8,)  # banned tokens, and what follows them
    assert grow(node, 1, 0.0, 1, (), 1).tokens == (7,)


def test_best_candidate_scales_the_draft_with_the_match() -> None:
    tree = SuffixTree(10)
    tree.add([1, 2, 3, 4, 5, 6, 7, 8])
    context = [9, 2, 3]  # matches "3" and "2 3", not "9 2 3"
    nodes = match(tree, context)
    assert len(nodes) == 2
    assert best_candidate(nodes, 8, 1.0, 0.1, 1, ()).tokens == (4, 5)  # factor 1 x match 2
    assert best_candidate(nodes, 8, 2.0, 0.1, 1, ()).tokens == (4, 5, 6, 7)
    assert best_candidate(nodes, 3, 2.0, 0.1, 1, ()).tokens == (4, 5, 6)
    assert best_candidate(nodes, 0, 2.0, 0.1, 1, ()).tokens == ()
    assert best_candidate([], 8, 2.0, 0.1, 1, ()).tokens == ()


def _drafter(**kwargs: object) -> SuffixDrafter:
    config = {"suffix_decoding_max_tree_depth": 8, "suffix_decoding_max_spec_factor": 2.0}
    return SuffixDrafter(SuffixConfig(**{**config, **kwargs}), (EOS,))


def _propose(drafter: SuffixDrafter, seq: FakeSeq, limit: int = 64) -> list[int]:
    draft = drafter.propose([seq], budgets([limit]))[0]
    assert draft.probs is None and draft.tokens.dtype == torch.long
    return draft.tokens.tolist()


def test_drafts_the_continuation_of_the_request_itself() -> None:
    drafter = _drafter()
    seq = FakeSeq("a", [1, 2, 3, 4, 5, 6, 7, 0, 2, 3], num_prompt_tokens=10)
    assert _propose(drafter, seq) == [4, 5, 6, 7]  # match "2 3" (2 tokens) x factor 2
    seq.token_ids += [4, 5, 6]
    drafter.commit(seq, Verdict(2, torch.tensor([4, 5, 6])), NO_TARGET_OUTPUTS)
    # "2 3 4 5 6" leaves 3 tokens under depth 8; the best score is "4 5 6" + 5 tokens
    assert _propose(drafter, seq) == [7, 0, 2, 3, 4]
    assert _propose(drafter, seq, limit=2) == [7, 0]
    assert _propose(_drafter(num_speculative_tokens=1), seq) == [7]


def test_never_drafts_eos_nor_past_it() -> None:
    seq = FakeSeq("a", [1, 2, 3, EOS, 4, 1, 2], num_prompt_tokens=7)
    assert _propose(_drafter(), seq) == [3]


def test_the_global_trie_holds_finished_outputs_oldest_evicted_first() -> None:
    drafter = _drafter(suffix_decoding_max_cached_requests=1)
    first = FakeSeq("a", [50, 51, 1, 2, 3, 4, 5], num_prompt_tokens=2)
    drafter.propose([first], budgets([8]))
    drafter.release("a")  # its output 1 2 3 4 5 joins the global trie, not its prompt
    assert paths(drafter.global_tree) == reference_paths([[1, 2, 3, 4, 5]], 8)
    other = FakeSeq("b", [60, 61, 1, 2], num_prompt_tokens=3)
    assert _propose(drafter, other) == [3, 4, 5]
    second = FakeSeq("c", [70, 8, 9], num_prompt_tokens=1)
    drafter.propose([second], budgets([8]))
    drafter.release("c")
    assert paths(drafter.global_tree) == reference_paths([[8, 9]], 8)  # "a" was evicted
    assert _propose(drafter, other) == []  # the re-matched cursor finds nothing now
    drafter.release("b")
    drafter.release("never seen")
    assert not drafter._states


def test_no_global_trie_when_nothing_is_cached() -> None:
    drafter = _drafter(suffix_decoding_max_cached_requests=0)
    drafter.propose([FakeSeq("a", [1, 2, 3, 4], num_prompt_tokens=1)], budgets([4]))
    drafter.release("a")
    assert drafter.global_tree.num_nodes == 0
    assert _propose(drafter, FakeSeq("b", [9, 2, 3], num_prompt_tokens=1)) == []


def test_tree_drafts_hold_several_continuations() -> None:
    drafter = _drafter(tree_width=3, suffix_decoding_min_token_prob=0.0)
    seq = FakeSeq("a", [1, 2, 7, 1, 2, 8, 1, 2, 9, 1, 2], num_prompt_tokens=11)
    draft = drafter.propose([seq], budgets([8]))[0]
    assert draft.tree is not None
    firsts = {t for t, p in zip(draft.tokens.tolist(), draft.tree.parents, strict=True) if p < 0}
    assert firsts == {7, 8, 9}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be an int in 1..256"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens must be an int in 1..64"),
        ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests must be an int >= 0"),
        ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor must be a number > 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, r"min_token_prob must be in 0..1"),
        ({"tree_width": 0}, "tree_width must be an int in 1..64"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        SuffixConfig(**kwargs)


def test_default_draft_length_follows_the_depth() -> None:
    assert SuffixConfig().num_speculative_tokens == 24
    assert SuffixConfig(suffix_decoding_max_tree_depth=100).num_speculative_tokens == 64
    assert SuffixConfig().suffix_decoding_max_cached_requests == 256  # bounded memory


@pytest.mark.parametrize("width", [1, 3])
def test_greedy_output_equals_plain_decoding(tiny_model_dir: Path, width: int) -> None:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    config = {"method": "suffix", "suffix_decoding_min_token_prob": 0.0, "tree_width": width}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    for _ in range(2):  # the second run also drafts from the first run's outputs
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.spec_metrics.num_accepted_tokens > 0
    assert llm.engine.drafter.global_tree.num_nodes > 0 and not llm.engine.drafter._states


@pytest.mark.parametrize("biased", [False, True])
def test_certify_passes_and_a_biased_verifier_fails(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    if biased:
        monkeypatch.setattr(verifier, "verify_chain", always_accept)
    config = {"method": "suffix", "suffix_decoding_min_token_prob": 0.0}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    prompt = (5, 17, 42, 5, 17, 42, 5, 17)
    result = certify(llm, CertifyConfig(prompt, top_k=4, num_samples=4000, seed=3))
    print(result.as_dict())
    assert result.num_draft_tokens > 1000
    assert result.passed is not biased
