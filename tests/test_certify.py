"""`specdecode certify` on a tiny model: correct drafters pass, a biased verifier fails, the
enumerated target distribution is right, bad input is refused, and the CLI's exit codes."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, build_tiny_model

from specdecode import certify as certify_module
from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.certify import CertifyConfig, certify
from specdecode.cli import main
from specdecode.drafters.base import DrafterBase, SeqView
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling import decide as verifier
from specdecode.sampling import tree as tree_verifier
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verify_chain
from specdecode.sampling_params import SamplingParams
from specdecode.tree.token_tree import ROOT, TokenTree
from specdecode.types import Draft, DraftBudget

SAMPLES = 20_000  # runs of the pass / fail tests: enough power for the biases below
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("certify_target"), "llama")


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny random model, with the same vocabulary: a draft model far from the target."""
    return build_tiny_model(tmp_path_factory.mktemp("certify_other"), "llama", seed=1)


@pytest.fixture(scope="module")
def target(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def prompt(target: LLM) -> tuple[int, ...]:
    """A prompt followed by its own sampled continuation: the next tokens sampled often appear
    in it, so ngram drafts on most runs."""
    start = [5, 17, 42]
    params = SamplingParams(top_k=4, max_tokens=12, seed=0, ignore_eos=True)
    (out,) = target.generate({"prompt_token_ids": start}, params)
    return (*start, *out.token_ids)


class UnigramDrafter(DrafterBase):
    """A sampling drafter (q != p): K tokens drawn independently, with the sequence's own
    generator, from the frequencies of the sequence's tokens so far."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        drafts = []
        for seq, budget in zip(seqs, budgets, strict=True):
            k = min(self.k, budget.max_tokens)
            q = torch.bincount(torch.tensor(seq.token_ids), minlength=TINY_VOCAB).float()
            q /= q.sum()  # [V]
            tokens = torch.multinomial(q, k, replacement=True, generator=seq.generator) if k else []
            drafts.append(Draft(torch.as_tensor(tokens, dtype=torch.long), q.expand(k, -1)))
        return drafts


class UnigramTreeDrafter(UnigramDrafter):
    """A sampled tree: up to K children of the root drawn i.i.d. from the unigram q (each
    node's q row is q: SpecInfer's i.i.d. children)."""

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        chains = super().propose(seqs, budgets)
        return [Draft(d.tokens, d.probs, TokenTree((ROOT,) * len(d.tokens))) for d in chains]


def _unigram_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", drafter=UnigramDrafter(2))


@pytest.mark.slow
def test_ngram_passes(target: LLM, prompt: tuple[int, ...]) -> None:
    llm = target.with_speculative_config(NGRAM)
    result = certify(llm, CertifyConfig(prompt, top_k=4, num_samples=SAMPLES))
    print(f"ngram: {result.as_dict()}")
    assert result.passed and result.test == "exact" and result.num_impossible == 0
    assert result.num_draft_tokens > SAMPLES // 2 and result.num_bins > 10


@pytest.mark.slow
def test_sampling_drafter_passes(model_dir: Path, prompt: tuple[int, ...]) -> None:
    config = CertifyConfig(prompt, top_k=4, num_samples=SAMPLES, seed=1)
    result = certify(_unigram_llm(model_dir), config)
    print(f"sampled q: {result.as_dict()}")
    assert result.passed and result.test == "exact"
    assert result.num_draft_tokens == SAMPLES and 0.1 < result.acceptance_rate < 0.9


def test_biased_verifier_fails(
    model_dir: Path, prompt: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepting a sampled draft token x with probability p(x), as if q were one-hot on x, but
    recovering from the true residual max(p - q, 0) emits the wrong distribution."""
    sampled_calls = []

    def biased(target_probs, draft_tokens, draft_probs, *args, **kwargs):
        if draft_probs is not None:
            sampled_calls.append(draft_tokens.shape)
            draft_probs = draft_probs.scatter(-1, draft_tokens[..., None], 1.0)
        return verify_chain(target_probs, draft_tokens, draft_probs, *args, **kwargs)

    monkeypatch.setattr(verifier, "verify_chain", biased)
    config = CertifyConfig(prompt, top_k=4, num_samples=SAMPLES, seed=1)
    result = certify(_unigram_llm(model_dir), config)
    print(f"biased: {result.as_dict()}")
    assert sampled_calls and result.num_draft_tokens == SAMPLES  # the biased path ran
    assert not result.passed and result.p_value < 1e-6


@pytest.mark.parametrize("biased", [False, True])
def test_sampled_trees_pass_and_a_tree_verifier_without_residual_updates_fails(
    model_dir: Path, prompt: tuple[int, ...], monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    if biased:
        monkeypatch.setattr(tree_verifier, "_residual", lambda r, x, q: r)
    llm = LLM(str(model_dir), dtype="float32", drafter=UnigramTreeDrafter(3))
    config = CertifyConfig(prompt, num_tokens=4, top_k=4, num_samples=SAMPLES, seed=2)
    result = certify(llm, config)
    print(f"tree (biased={biased}): {result.as_dict()}")
    assert llm.spec_metrics.num_tree_drafts > 0
    assert result.passed != biased
    if biased:
        assert result.p_value < 1e-6


def always_accept(target_probs, draft_tokens, draft_probs, num_draft, *args, **kwargs):
    """BIASED: keeps every draft token (p made one-hot on it), then the bonus token."""
    sure = target_probs.clone()  # [B, K + 1, V]
    for i in range(draft_tokens.shape[1]):
        rows = (num_draft > i).nonzero()[:, 0]  # rows with a real draft token at position i
        sure[rows, i] = torch.nn.functional.one_hot(draft_tokens[rows, i], sure.shape[-1]).float()
    return verify_chain(sure, draft_tokens, draft_probs, num_draft, *args, **kwargs)


def test_a_sequence_the_target_cannot_produce_fails_at_once(
    target: LLM, prompt: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifier that keeps every draft token emits ngram drafts outside the top-k."""
    monkeypatch.setattr(verifier, "verify_chain", always_accept)
    llm = target.with_speculative_config(NGRAM)
    result = certify(llm, CertifyConfig(prompt, top_k=4, num_samples=500))
    assert result.num_impossible > 0 and result.p_value == 0.0 and not result.passed


def test_two_sample_fallback_passes(
    target: LLM, prompt: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(certify_module, "MAX_OUTCOMES", 0)  # too many prefixes to enumerate
    llm = target.with_speculative_config(NGRAM)
    result = certify(llm, CertifyConfig(prompt, top_k=4, num_samples=3000, seed=2))
    print(f"two-sample: {result.as_dict()}")
    assert result.test == "two-sample" and result.passed and result.num_bins > 10


def _brute_force(target: LLM, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V] target probability of every two-token continuation, each prefix run alone from
    scratch (one full prefill of prompt + first token)."""
    model, vocab = target.model, target.model.config.vocab_size
    tokens = torch.tensor([[*prompt, t] for t in range(vocab)])  # [V, L + 1]
    meta = AttentionMetadata.prefill([tokens.shape[1]] * vocab, "cpu")
    logits, _ = model(tokens, meta, model.new_cache(vocab, tokens.shape[1]))  # [V, L + 1, V]
    first = probs_from_logits(logits[:1, -2], SamplingTensors.from_params([params], "cpu"))
    second = probs_from_logits(logits[:, -1], SamplingTensors.from_params([params] * vocab, "cpu"))
    return first[0, :, None].double() * second.double()  # p(a) p(b | a)


@pytest.mark.parametrize(
    "sampling", [{"top_k": 3}, {"top_p": 0.5, "temperature": 0.7}], ids=["top_k", "top_p"]
)
def test_enumeration_matches_brute_force(target: LLM, sampling: dict[str, object]) -> None:
    prompt = [5, 17, 42, 99]
    config = CertifyConfig(prompt, num_tokens=2, num_samples=10**9, **sampling)  # every sequence
    enumeration = certify_module._Enumeration(target.model, prompt, config, Counter())
    cells = enumeration.run()
    assert cells is not None
    probs = {key: expected / config.num_samples for key, (_, expected) in cells.items()}
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
    exact = _brute_force(target, prompt, config.params(0))  # [V, V]
    sequences = {key: p for key, p in probs.items() if len(key) == 2}
    assert len(sequences) == int((exact > 0).sum()) > 1
    for (a, b), p in sequences.items():
        assert p == pytest.approx(float(exact[a, b]), rel=1e-4)


def test_rare_bins_merge_into_their_prefix_and_pvalues_are_right() -> None:
    cells = {(1, 2): (3, 3.0), (1, 3): (4, 4.0), (2, 1): (50, 50.0), (1,): (0, 0.5), (): (1, 1.0)}
    table = certify_module._table(cells, lambda cell: cell[1], 2)  # [2, C]
    # (1, 2) and (1, 3) join (1,): 7.5 expected; () (1.0) joins that, the smallest column
    assert sorted(table.T.tolist()) == [[8.0, 8.5], [50.0, 50.0]]
    for df, quantile in [(1, 3.841), (5, 11.070), (34, 48.602)]:  # textbook 5% quantiles
        assert certify_module._survival(quantile, df) == pytest.approx(0.05, abs=1e-3)
    assert certify_module._survival(0.0, 0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0}, r"num_samples must be an int >= 1"),
        ({"alpha": 0.0}, r"alpha must be in \(0, 1\)"),
        ({"alpha": 1.5}, r"alpha must be in \(0, 1\)"),
        ({"temperature": 0.0}, r"temperature must be > 0, got 0.0: certify checks sampling"),
        ({"num_tokens": 0}, r"num_tokens must be an int in 1\.\.16"),
        ({"prompt": ""}, r"prompt must be non-empty text or token ids"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"batch_size": 0}, r"batch_size must be an int >= 1"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        CertifyConfig(**kwargs)


def test_plain_decoding_and_drafterless_runs_are_refused(
    target: LLM, prompt: tuple[int, ...]
) -> None:
    with pytest.raises(UserError, match="certify needs a speculative LLM"):
        certify(target, CertifyConfig(prompt, num_samples=10))
    llm = target.with_speculative_config(NGRAM)  # 2 tokens: the last one is never drafted
    with pytest.raises(UserError, match="the drafter proposed no token in 10 runs of 2 tokens"):
        certify(llm, CertifyConfig(prompt, num_tokens=2, num_samples=10))


def test_cli_exit_codes(
    model_dir: Path,
    other_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["certify", "--model", str(model_dir), "--dtype", "float32", "--top-k", "4"]
    draft = json.dumps({"model": str(model_dir), "num_speculative_tokens": 2})  # q = p
    assert main([*args, "--speculative-config", draft, "--samples", "1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["test"] == "exact" and out["num_samples"] == 1000
    assert main(args) == 2
    assert "certify needs --speculative-config" in capsys.readouterr().err
    assert main([*args, "--speculative-config", draft, "--alpha", "2"]) == 2
    assert "alpha must be in (0, 1)" in capsys.readouterr().err
    assert main([*args, "--speculative-config", draft, "--samples", "300"]) == 0
    assert "PASS" in capsys.readouterr().out
    monkeypatch.setattr(verifier, "verify_chain", always_accept)
    far = json.dumps({"model": str(other_dir), "num_speculative_tokens": 2})
    assert main([*args, "--speculative-config", far, "--samples", "200"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "probability 0" in out and "p-value 0," in out
