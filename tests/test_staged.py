"""Staged drafting: the draft model's own drafts guessed by ngram or suffix and checked in one
pass each; the output equals plain decoding, fewer draft-model passes, and sampling stays
exact (certify, and a biased inner check that the same test catches)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from spec_cases import GREEDY, PROMPTS, PassCounter
from test_certify import always_accept

from specdecode.certify import CertifyConfig, certify
from specdecode.drafters import staged
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

REPEATING = {"prompt_token_ids": [5, 17, 42, 8, 5, 17, 42, 8, 5, 17, 42, 8, 5]}


def _llm(model_dir: Path, **extra: object) -> LLM:
    config = {
        "model": str(model_dir),
        "num_speculative_tokens": 6,
        "draft_length": "fixed",
        **extra,
    }
    return LLM(model=str(model_dir), dtype="float32", speculative_config=config)


@pytest.mark.parametrize("stager", ["ngram", "suffix"])
def test_greedy_output_equals_plain_decoding_with_fewer_draft_passes(
    tiny_model_dir: Path, stager: str
) -> None:
    prompts = [*PROMPTS, REPEATING]
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    passes = {}
    for name, extra in (("token by token", {}), ("staged", {"staged": stager})):
        llm = _llm(tiny_model_dir, **extra)
        counter = PassCounter(llm.engine.drafter.model)
        llm.engine.drafter.model = counter
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        counter.passes = 0  # count sequences alone (token by token batches sequences)
        for prompt, want in zip(prompts, expected, strict=True):
            assert llm.generate(prompt, GREEDY)[0].token_ids == want
        passes[name] = counter.passes
    assert passes["staged"] < passes["token by token"]


def test_staged_configs_are_checked(tiny_model_dir: Path) -> None:
    with pytest.raises(UserError, match="staged must be one of None, 'ngram', 'suffix'"):
        _llm(tiny_model_dir, staged="eagle3")
    with pytest.raises(UserError, match="staged drafting prepares chains: use tree_width 1"):
        _llm(tiny_model_dir, staged="ngram", tree_width=2)


@pytest.fixture(scope="module")
def flatter_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with its final norm scaled by 0.4: the same top tokens with flatter
    probabilities, so q overlaps p and the target accepts a draft token often, not always."""
    out = tmp_path_factory.mktemp("flatter_draft")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 0.4
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.one_architecture
@pytest.mark.parametrize("biased", [False, True])
def test_certify_passes_and_a_biased_inner_check_fails(
    tiny_model_dir: Path, flatter_draft_dir: Path, monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """A draft model that keeps every guess (as if q accepted it) drafts tokens whose
    distribution is not the q it reports: the target's output goes wrong. The draft model's
    q overlaps the target's p, so the exact run accepts and rejects draft tokens alike."""
    if biased:
        monkeypatch.setattr(staged, "verify_chain", always_accept)
    config = {"model": str(flatter_draft_dir), "num_speculative_tokens": 3, "staged": "suffix"}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    prompt = (5, 17, 42, 5, 17, 42, 5, 17)
    params = CertifyConfig(prompt, num_tokens=4, top_k=4, num_samples=4000, seed=3)
    result = certify(llm, params)
    print(result.as_dict())
    assert result.num_draft_tokens > 1000 and 0.05 < result.acceptance_rate < 0.95
    assert result.passed is not biased


def test_sampled_runs_are_reproducible(tiny_model_dir: Path) -> None:
    llm = _llm(tiny_model_dir, staged="ngram")  # (suffix's global trie remembers run 1)
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True)
    first, second = llm.generate(PROMPTS, params), llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
