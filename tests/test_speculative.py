"""Speculative decoding is lossless: greedy output equals plain greedy output, token for token."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from drafter_examples import example_config
from spec_cases import GREEDY, PROMPTS, assert_fully_accepted

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.drafters.base import DrafterBase, DrafterNeeds, SeqView
from specdecode.drafters.registry import DRAFTERS
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, DraftBudget, TargetFeatures, TargetOutputs, Verdict


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def expected(plain: LLM) -> list[list[int]]:
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


class OracleDrafter(DrafterBase):
    """Proposes the target's own greedy continuation (draft = target)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.continuations, self.k = continuations, k

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        drafts = []
        for seq, budget in zip(seqs, budgets, strict=True):
            ids, limit = seq.token_ids, budget.max_tokens
            for prompt, cont in self.continuations.items():
                if tuple(ids[: len(prompt)]) == prompt:
                    done = len(ids) - len(prompt)
                    nxt = cont[done : done + min(self.k, limit)]
                    drafts.append(Draft(torch.tensor(nxt, dtype=torch.long)))
        return drafts


class RandomDrafter(DrafterBase):
    """Proposes random tokens (deterministic drafter: q one-hot)."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k, self.vocab, self.gen = k, vocab, torch.Generator().manual_seed(0)

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        return [
            Draft(torch.randint(0, self.vocab, (min(self.k, b.max_tokens),), generator=self.gen))
            for b in budgets
        ]


def _with_drafter(model_dir: Path, drafter) -> LLM:
    """The model in fp32 with `drafter` (a user's own Drafter)."""
    return LLM(model=str(model_dir), dtype="float32", drafter=drafter)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_greedy_equals_plain_batch_and_single(
    tiny_model_dir: Path, expected: list[list[int]], k: int
) -> None:
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    batched = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in batched] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert llm.spec_metrics.num_draft_tokens > 0  # the drafter really drafted


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_equal_to_target_is_fully_accepted(
    tiny_model_dir: Path, expected: list[list[int]], k: int
) -> None:
    continuations = {
        tuple(p["prompt_token_ids"]): e for p, e in zip(PROMPTS, expected, strict=True)
    }
    llm = _with_drafter(tiny_model_dir, OracleDrafter(continuations, k))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert_fully_accepted(outs, k)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_random_drafts_are_rejected_and_output_unchanged(
    tiny_model_dir: Path, expected: list[list[int]], k: int
) -> None:
    llm = _with_drafter(tiny_model_dir, RandomDrafter(k, 300))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert llm.spec_metrics.acceptance_rate < 0.1


def test_plain_decoding_has_tau_one(plain: LLM) -> None:
    (out,) = plain.generate(PROMPTS[0], GREEDY)
    spec = out.metrics.spec
    assert spec.num_steps == 40 and spec.mean_acceptance_length == 1.0
    assert spec.num_draft_tokens == 0 and spec.acceptance_rate == 0.0


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_never_exceeded_by_a_step(
    tiny_model_dir: Path, expected: list[list[int]], max_tokens: int
) -> None:
    continuations = {
        tuple(p["prompt_token_ids"]): e for p, e in zip(PROMPTS, expected, strict=True)
    }
    llm = _with_drafter(tiny_model_dir, OracleDrafter(continuations, 8))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for out, want in zip(llm.generate(PROMPTS, params), expected, strict=True):
        assert list(out.token_ids) == want[:max_tokens]


def test_sampling_with_a_seed_is_reproducible(tiny_model_dir: Path) -> None:
    config = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=3, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    second = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "hydra", "num_speculative_tokens": 2}, "method 'hydra' is not supported"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"must be an int in 1\.\.64"),
        ({"method": "ngram", "num_speculative_tokens": 65}, r"must be an int in 1\.\.64"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown speculative_config"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
            "1 <= prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_configs(tiny_model_dir: Path, config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)


def test_draft_model_config_greedy_equals_plain(
    tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    config = {
        "model": str(tiny_model_dir),
        "num_speculative_tokens": 3,
        "draft_length": "fixed",
    }  # = target
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert llm.spec_metrics.acceptance_rate >= 0.98


def test_draft_model_with_another_vocabulary_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tiny_tokenizer import make_byte_tokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (other / "tokenizer.json").unlink()
    make_byte_tokenizer(other, vocab_size=290)  # fewer filler tokens than the target's 300
    config = {"model": str(other), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=r"different vocabulary from the target \(290 vs 300"):
        LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)


def test_eos_inside_a_draft_stops_generation_there(
    tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    """The oracle drafts straight through an EOS; output ends at it, exactly like plain."""
    # Declare an end-of-sequence token one that first appears a few tokens into a continuation.
    row, stop_at = next(
        (row, i)
        for row, cont in enumerate(expected)
        for i in range(2, len(cont))
        if cont[i] not in cont[:i]
    )
    continuation, prompt = expected[row], PROMPTS[row]
    eos = continuation[stop_at]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    continuations = {tuple(prompt["prompt_token_ids"]): continuation}
    outs = []
    for drafter in (None, OracleDrafter(continuations, 8)):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", drafter=drafter)
        llm.tokenizer.eos_token_ids = (eos,)
        (out,) = llm.generate(prompt, params)
        outs.append(out)
    plain_out, spec_out = outs
    assert list(spec_out.token_ids) == continuation[: stop_at + 1] == list(plain_out.token_ids)
    assert spec_out.outputs[0].finish_reason == "stop" and spec_out.outputs[0].stop_reason == eos
    assert spec_out.metrics.spec.num_draft_tokens > len(spec_out.token_ids) - 1  # drafted past it


class FeatureRecorder(OracleDrafter):
    """The oracle, asking for the target's hidden states and recording what each commit saw."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int, layers) -> None:
        super().__init__(continuations, k)
        self.needs = DrafterNeeds(hidden_layers=layers)
        self.seen: list[tuple[list[int], TargetFeatures]] = []

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        assert target.hidden is not None and target.argmax is None
        self.seen.append((seq.token_ids, target.hidden))


def test_drafter_sees_the_hidden_states_it_asks_for(
    tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    """Each pass leaves the requested layers' states of the tokens it kept, equal to a fresh
    pass over the same tokens; the output does not change."""
    continuations = {
        tuple(p["prompt_token_ids"]): e for p, e in zip(PROMPTS, expected, strict=True)
    }
    model = LLM(model=str(tiny_model_dir), dtype="float32").model
    layers = (1, model.config.num_layers)
    recorder = FeatureRecorder(continuations, 3, layers)
    llm = _with_drafter(tiny_model_dir, recorder)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert len(recorder.seen) > len(PROMPTS)
    for ids, features in recorder.seen[:12]:
        end = features.start + features.hidden.shape[0]
        assert end <= len(ids) - 1  # the newest token has not been fed yet
        meta = AttentionMetadata.prefill([end], "cpu")
        _, fresh = model(
            torch.tensor([ids[:end]]), meta, model.new_cache(1, end), hidden_layers=layers
        )
        assert features.hidden.shape[1] == 2 * model.config.hidden_size
        torch.testing.assert_close(
            features.hidden, fresh[0, features.start :], atol=1e-4, rtol=1e-4
        )


def test_a_drafter_must_be_a_drafter(tiny_model_dir: Path) -> None:
    members = "propose, catch_up, commit, release, needs, setup_s, names"
    with pytest.raises(ValueError, match=f"lacks {members}"):
        LLM(model=str(tiny_model_dir), dtype="float32", drafter=object())
    config = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="either speculative_config or drafter"):
        LLM(str(tiny_model_dir), speculative_config=config, drafter=RandomDrafter(2, 300))


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_every_registered_drafter_is_lossless(
    tiny_model_dir: Path, expected: list[list[int]], method: str
) -> None:
    """The contract test over the registry: greedy output equals plain decoding, batched and
    alone, and sampling with a seed is reproducible."""
    config = example_config(method, tiny_model_dir)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert list(llm.generate(PROMPTS[1], GREEDY)[0].token_ids) == expected[1]
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True)
    first, second = llm.generate(PROMPTS, params), llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


class ReleaseCounter(RandomDrafter):
    """Random drafts; counts the releases of each request id."""

    def __init__(self, k: int, vocab: int) -> None:
        super().__init__(k, vocab)
        self.released: dict[str, int] = {}

    def release(self, request_id: str) -> None:
        self.released[request_id] = self.released.get(request_id, 0) + 1


def test_each_request_is_released_once(tiny_model_dir: Path) -> None:
    drafter = ReleaseCounter(3, 300)
    llm = _with_drafter(tiny_model_dir, drafter)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outs = llm.generate(PROMPTS, params)
    assert drafter.released == {o.request_id: 1 for o in outs}
    assert llm.engine.outputs._texts == {}


def test_stopping_a_stream_early_releases_everything(tiny_model_dir: Path) -> None:
    # "fixed": the default "cost" policy prices measured passes and may never draft at all
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 2, "draft_length": "fixed"}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    stream = llm.stream(PROMPTS[0], params)
    out = next(stream)
    while not llm.engine.drafter._caches:  # until the drafter holds state for the request
        out = next(stream)
    assert not out.finished
    stream.close()
    assert llm.engine.outputs._texts == {} and not llm.engine.drafter._caches


class LongDrafter(RandomDrafter):
    """Breaks the contract: drafts more tokens than allowed."""

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        return [Draft(torch.zeros(b.max_tokens + 1, dtype=torch.long)) for b in budgets]


def test_drafts_that_break_the_contract_are_refused(tiny_model_dir: Path) -> None:
    llm = _with_drafter(tiny_model_dir, LongDrafter(3, 300))
    with pytest.raises(ValueError, match=r"draft 0 must be a 1-D int64 tensor of at most"):
        llm.generate(PROMPTS[0], GREEDY)
    bad = RandomDrafter(2, 300)
    bad.needs = DrafterNeeds(hidden_layers=(99,))
    with pytest.raises(ValueError, match=r"needs must be a DrafterNeeds whose hidden_layers"):
        _with_drafter(tiny_model_dir, bad)
