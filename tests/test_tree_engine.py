"""Tree speculation through the engine: greedy output equals plain decoding token for token for
every tree-capable drafter, batched rows with different tree shapes; a fully right branch is
fully accepted; tree metrics; hidden states along the kept path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_eagle3_head, build_tiny_exit_head
from spec_cases import GREEDY, PROMPTS
from test_speculative import FeatureRecorder, OracleDrafter

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.drafters.base import DrafterNeeds, SeqView
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.tree.token_tree import ROOT, TokenTree
from specdecode.types import Draft, DraftBudget

TREE_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
              "tree_width": 3, "tree_depth": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "tree_width": 3,
               "suffix_decoding_min_token_prob": 0.0, "suffix_decoding_max_cached_requests": 0},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3,
                  "guess_set_size": 3},
    "draft_model": {"num_speculative_tokens": 8, "tree_width": 3, "tree_depth": 3,
                    "draft_length": "fixed"},  # the default prices steps by measured time
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 8, "tree_width": 3,
               "tree_depth": 3},
    "medusa": {"method": "medusa", "num_speculative_tokens": 8, "tree_width": 3,
               "tree_depth": 3},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 8, "tree_width": 3,
                   "tree_depth": 3},
}  # fmt: skip


# A prompt whose suffix (1, 2) occurred before with three different continuations.
BRANCHY = [*PROMPTS, {"prompt_token_ids": [1, 2, 7, 1, 2, 8, 5, 1, 2, 9, 6, 3, 1, 2]}]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(BRANCHY, GREEDY)]


def _continuations(expected: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p["prompt_token_ids"]): e for p, e in zip(BRANCHY, expected, strict=True)}


class TreeOracle(OracleDrafter):
    """A random tree per step (its size depending on the row) with the target's continuation
    hidden on one branch and random tokens elsewhere."""

    def __init__(self, continuations, k: int, vocab: int = 300) -> None:
        super().__init__(continuations, k)
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(0)

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        chains = super().propose(seqs, budgets)
        drafts = []
        limits = [b.max_tokens for b in budgets]
        for row, (chain, limit) in enumerate(zip(chains, limits, strict=True)):
            right = chain.tokens.tolist()
            size = min(limit, len(right) + 2 + row)  # rows get different shapes
            parents, tokens, path = [], [], [ROOT]
            for node in range(size):
                if node % 2 == 0 and len(path) <= len(right):  # the right branch, node by node
                    parents.append(path[-1])
                    tokens.append(right[len(path) - 1])
                    path.append(node)
                else:  # a random node anywhere
                    parents.append(int(torch.randint(-1, node, (1,), generator=self.gen)))
                    tokens.append(int(torch.randint(0, self.vocab, (1,), generator=self.gen)))
            drafts.append(
                Draft(torch.tensor(tokens, dtype=torch.long), tree=TokenTree(tuple(parents)))
            )
        return drafts


@pytest.mark.parametrize("method", sorted(TREE_CONFIGS))
def test_tree_drafters_are_lossless(
    tiny_model_dir: Path, expected: list[list[int]], method: str
) -> None:
    config = dict(TREE_CONFIGS[method])
    if method == "draft_model":
        config["model"] = str(tiny_model_dir)
    if method == "eagle3":
        config["model"] = str(build_tiny_eagle3_head(tiny_model_dir, tiny_model_dir / "eagle3"))
    if method in ("medusa", "layer_skip"):
        config["model"] = str(build_tiny_exit_head(tiny_model_dir, tiny_model_dir / method, method))
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    assert [list(o.token_ids) for o in llm.generate(BRANCHY, GREEDY)] == expected
    assert list(llm.generate(BRANCHY[1], GREEDY)[0].token_ids) == expected[1]
    spec = llm.spec_metrics
    assert spec.num_drafts > 0
    if method not in ("ngram", "suffix"):  # the tiny models repeat themselves: trees from
        # their history are rare
        assert spec.num_tree_drafts > 0 and spec.mean_draft_size > spec.mean_draft_depth
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True)
    first, second = llm.generate(BRANCHY, params), llm.generate(BRANCHY, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_the_right_branch_of_random_trees_is_accepted(
    tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    llm = LLM(
        model=str(tiny_model_dir), dtype="float32", drafter=TreeOracle(_continuations(expected), 4)
    )
    outs = llm.generate(BRANCHY, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    spec = llm.spec_metrics
    assert spec.num_tree_drafts > 0
    assert spec.mean_acceptance_length > 3.0  # the oracle's branch is up to 4 deep


def test_a_draft_model_tree_on_itself_accepts_deep_paths(
    tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 6, "tree_width": 2,
              "tree_depth": 3, "draft_length": "fixed"}  # fmt: skip
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    outs = llm.generate(BRANCHY, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    spec = llm.spec_metrics
    # draft = target: the greedy path is the tree's most confident one, and nearly always
    # its deepest, so nearly every step accepts to the tree's depth
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_depth
    assert spec.accepted_per_position[:3] == sorted(spec.accepted_per_position[:3], reverse=True)
    assert set(spec.as_dict()) >= {"num_tree_drafts", "mean_draft_size", "mean_draft_depth"}


def test_hidden_states_follow_the_kept_path(
    tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    class TreeRecorder(TreeOracle):
        def __init__(self, continuations, k: int, layers) -> None:
            super().__init__(continuations, k)
            self.needs, self.seen = DrafterNeeds(hidden_layers=layers), []

        commit = FeatureRecorder.commit

    model = LLM(model=str(tiny_model_dir), dtype="float32").model
    layers = (1, model.config.num_layers)
    recorder = TreeRecorder(_continuations(expected), 3, layers)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", drafter=recorder)
    assert [list(o.token_ids) for o in llm.generate(BRANCHY, GREEDY)] == expected
    for ids, features in recorder.seen[:12]:
        end = features.start + features.hidden.shape[0]
        meta = AttentionMetadata.prefill([end], "cpu")
        _, fresh = model(
            torch.tensor([ids[:end]]), meta, model.new_cache(1, end), hidden_layers=layers
        )
        torch.testing.assert_close(
            features.hidden, fresh[0, features.start :], atol=1e-4, rtol=1e-4
        )


def test_bad_tree_configs_are_refused(tiny_model_dir: Path) -> None:
    wide = {"method": "ngram", "num_speculative_tokens": 4, "tree_width": 0}
    with pytest.raises(ValueError, match=r"tree_width must be an int in 1\.\.64"):
        LLM(str(tiny_model_dir), speculative_config=wide)
    deep = {"model": str(tiny_model_dir), "num_speculative_tokens": 4, "tree_depth": 5}
    with pytest.raises(ValueError, match="tree_depth applies to trees"):
        LLM(str(tiny_model_dir), speculative_config=deep)
    with pytest.raises(ValueError, match="tree_depth must be None"):
        LLM(str(tiny_model_dir), speculative_config={**deep, "tree_width": 2})


def test_a_tree_that_does_not_fit_its_tokens_is_refused(tiny_model_dir: Path) -> None:
    class Misfit(OracleDrafter):
        def propose(self, seqs, budgets):
            return [Draft(torch.tensor([1, 2]), tree=TokenTree((-1,))) for _ in seqs]

    llm = LLM(str(tiny_model_dir), dtype="float32", drafter=Misfit({}, 2))
    with pytest.raises(ValueError, match="tree must be a TokenTree of 2 nodes"):
        llm.generate(BRANCHY[0], GREEDY)
