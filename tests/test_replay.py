"""Replaying a drafter over the target's greedy text (what `specdecode plan` prices)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from conftest import build_tiny_mtp

from specdecode.bench.plan import target_states
from specdecode.bench.replay import accepted_path, replay
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft


def test_replay_walks_drafts_as_a_greedy_run_would(tiny_model_dir: Path) -> None:
    """Replaying a drafter over the target's greedy text gives the steps that a real greedy
    run with that drafter takes (its counters)."""
    tree = Draft(torch.tensor([5, 6, 7]), tree=TokenTree((-1, -1, 1)))
    assert accepted_path(tree, [6, 7, 9]) == (1, 2) and accepted_path(tree, [9]) == ()
    llm = LLM(str(tiny_model_dir), dtype="float32")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = list(llm.generate({"prompt_token_ids": prompt}, params)[0].token_ids)
    layer = build_tiny_mtp(tiny_model_dir, tiny_model_dir / "mtp-deepseek_v3", "deepseek_v3")
    for config in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        {"model": str(tiny_model_dir), "num_speculative_tokens": 6, "tree_width": 2,
         "tree_depth": 3, "draft_length": "fixed"},
        {"method": "mtp", "model": str(layer), "num_speculative_tokens": 3},  # reads states
        {"method": "mtp", "model": str(layer), "num_speculative_tokens": 4, "tree_width": 2},
    ):  # fmt: skip
        spec = llm.with_speculative_config(config)
        real = spec.generate({"prompt_token_ids": prompt}, params)[0].metrics.spec
        drafter = spec.engine.drafter
        states = partial(target_states, llm.model, drafter.needs.hidden_layers)
        stats = replay(drafter, [(prompt, text)], states=states)
        assert stats.num_steps == real.num_steps - 1  # the prefill's token is left out
        assert stats.num_tokens == real.num_output_tokens - 1
        assert sum(stats.draft_sizes) == real.num_draft_tokens
