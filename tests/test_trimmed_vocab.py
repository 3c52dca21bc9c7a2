"""FR-Spec's trimmed draft head: lossless greedy output, drafts and q inside the kept tokens,
exact sampling, the head's rows in every weight format, the frequency table (bench-free,
cached) and the config's checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB
from head_cases import check_certify, check_reduced_vocabulary, record_drafts
from spec_cases import GREEDY, PROMPTS
from train_cases import chat_prompts, examples

from specdecode.bench.methods import MethodSpec
from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.corpus.examples import BenchFilter, Example, bench_texts
from specdecode.corpus.vocab import draft_vocabulary
from specdecode.drafters import trimmed_head
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.registry import parse_speculative_config
from specdecode.drafters.trimmed_head import (
    TrimmedHeadLM,
    frequency_texts,
    frequent_tokens,
)
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling_params import SamplingParams

KEPT = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(5))[:64].sort().values


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _trimmed(target_dir: Path, draft_dir: Path, kept: torch.Tensor, k: int, **tree) -> LLM:
    """The target with a `DraftModelDrafter` over the model in `draft_dir`, head cut to `kept`."""
    draft = TrimmedHeadLM(load_model(draft_dir, dtype="float32"), kept)
    drafter = DraftModelDrafter(draft, k, TINY_VOCAB, **tree)
    return LLM(model=str(target_dir), dtype="float32", drafter=drafter)


@pytest.mark.parametrize(
    "spec", [{"k": 3}, {"k": 8}, {"k": 4, "tree_width": 2}], ids=["chain3", "chain8", "tree"]
)
def test_greedy_equals_plain_batched_and_alone(
    tiny_model_dir: Path, other_draft_dir: Path, expected: list[list[int]], spec: dict
) -> None:
    llm = _trimmed(tiny_model_dir, other_draft_dir, KEPT, **spec)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0  # it really drafted


def test_drafts_stay_in_the_kept_tokens_and_q_is_zero_outside(
    tiny_model_dir: Path, other_draft_dir: Path, expected: list[list[int]]
) -> None:
    """Sampled chains: tokens and q only cover the kept tokens, while the target's output uses
    others; greedy trees: every node is a kept token."""
    check_reduced_vocabulary(_trimmed(tiny_model_dir, other_draft_dir, KEPT, 4), KEPT, expected)
    llm = _trimmed(tiny_model_dir, other_draft_dir, KEPT, 4, tree_width=2)
    seen = record_drafts(llm)
    llm.generate(PROMPTS, GREEDY)
    assert seen and all(d.tree is not None for d in seen if len(d.tokens) > 1)
    assert all(set(d.tokens.tolist()) <= set(KEPT.tolist()) for d in seen)


@pytest.mark.one_architecture
@pytest.mark.parametrize("biased", [False, True], ids=["exact", "biased-verifier"])
def test_sampling_matches_the_target_and_a_biased_verifier_fails(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """`certify`'s chi-square test over whole continuations, the target itself as the draft
    model with its head cut to the 64 tokens it samples most (q is neither one-hot nor p, and
    zero outside the kept tokens): exact; treating q as one-hot fails the same test."""
    plain = LLM(str(tiny_model_dir), dtype="float32")
    prompt = chat_prompts(tiny_model_dir, examples(1, 5000))[0]
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=1, ignore_eos=True)
    sampled = [o.token_ids for o in plain.generate([prompt] * 8, params)]
    kept = draft_vocabulary(sampled, 64, TINY_VOCAB)
    llm = _trimmed(tiny_model_dir, tiny_model_dir, kept, 2)
    check_certify(llm, tiny_model_dir, monkeypatch, biased)


@pytest.mark.parametrize(
    "fmt", [("float32", None), ("bfloat16", None), ("float32", "int8"), ("bfloat16", "q4_0")]
)
def test_trimmed_head_gives_the_full_heads_rows(tiny_model_dir: Path, fmt: tuple) -> None:
    """The trimmed logits are the full head's at the kept tokens (bit for bit in the row-exact
    bf16, int8 and GGUF formats) and -inf elsewhere; the hidden states are the model's."""
    dtype, quantization = fmt
    model = load_model(tiny_model_dir, dtype=dtype, quantization=quantization)
    trimmed = TrimmedHeadLM(model, KEPT)
    tokens = torch.tensor([[5, 17, 42, 99, 3, 250, 17]])  # [1, 7]
    index = torch.tensor([[2, 6]])  # [1, 2]
    results = []
    for lm in (model, trimmed):
        cache = lm.new_cache(1, 16)
        results.append(lm(tokens, AttentionMetadata.prefill([7], "cpu"), cache, logits_index=index))
    (full, full_hidden), (cut, cut_hidden) = results  # logits [1, 2, V]
    assert torch.equal(cut_hidden, full_hidden)
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[KEPT] = False
    assert bool((cut[..., outside] == float("-inf")).all())
    if dtype == "float32" and quantization is None:
        torch.testing.assert_close(cut[..., KEPT], full[..., KEPT], atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(cut[..., KEPT], full[..., KEPT])


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, r"draft_vocab_size must be None \(the whole head\) or an int in 1\.\.vocabulary"),
        (-3, "draft_vocab_size must be None"),
        (2.0, "draft_vocab_size must be None"),
        (True, "draft_vocab_size must be None"),
        ("64", "draft_vocab_size must be None"),
    ],
)
def test_bad_draft_vocab_size_is_refused(size: object, message: str) -> None:
    cfg = {"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": size}
    with pytest.raises(UserError, match=message):
        parse_speculative_config(cfg)


def test_draft_vocab_size_below_tree_width_or_above_the_vocabulary_is_refused(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = {"model": "m", "num_speculative_tokens": 4, "tree_width": 3, "draft_vocab_size": 2}
    with pytest.raises(UserError, match="draft_vocab_size 2 is smaller than tree_width 3"):
        parse_speculative_config(cfg)
    _small_frequency_source(monkeypatch, tmp_path)
    spec = {"model": str(tiny_model_dir), "num_speculative_tokens": 3, "draft_vocab_size": 301}
    with pytest.raises(UserError, match=r"draft_vocab_size must be in 1\.\.300 .*got 301"):
        LLM(str(tiny_model_dir), dtype="float32", speculative_config=spec)
    with pytest.raises(UserError, match="the kept tokens must be"):
        TrimmedHeadLM(load_model(tiny_model_dir, dtype="float32"), torch.tensor([3, 3]))


def test_the_bench_option_v_sets_draft_vocab_size() -> None:
    spec = MethodSpec.parse("draft:qwen2.5-coder-0.5b:k=3:v=32768")
    assert spec.config.drafter.draft_vocab_size == 32768
    assert spec.speculative_config()["draft_vocab_size"] == 32768


TEXTS = ["abc abc abc", "zzzz", "ab"]  # counts: a 4, b 4, c 3, space 2, z 4 (ids = bytes)


def _small_frequency_source(monkeypatch: pytest.MonkeyPatch, cache: Path) -> list[int]:
    """Point the table's cache at `cache` and its text at TEXTS; returns a counter of the
    times the text was read."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    reads: list[int] = []

    def texts(chars: int):
        reads.append(chars)
        return iter(TEXTS)

    monkeypatch.setattr(trimmed_head, "frequency_texts", texts)
    return reads


def test_the_frequency_table_ranks_tokens_and_is_cached(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _small_frequency_source(monkeypatch, tmp_path)
    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    eos = tokenizer.eos_token_ids[0]
    want = sorted([eos, ord("a"), ord("b"), ord("z"), ord("c")])
    assert frequent_tokens(tokenizer, 5, TINY_VOCAB, chars=100).tolist() == want
    assert frequent_tokens(tokenizer, 3, TINY_VOCAB, chars=100).tolist() == sorted(
        [eos, ord("a"), ord("b")]
    )
    assert reads == [100]  # the second table came from the cache file
    assert len(list((tmp_path / "frequency").glob("*.pt"))) == 1
    frequent_tokens(tokenizer, 3, TINY_VOCAB, chars=200)  # another amount: another file
    assert reads == [100, 200]


def test_speculative_config_trims_the_head_to_the_frequent_tokens(
    tiny_model_dir: Path,
    other_draft_dir: Path,
    expected: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _small_frequency_source(monkeypatch, tmp_path)
    spec = {"model": str(other_draft_dir), "num_speculative_tokens": 3, "draft_vocab_size": 5}
    llm = LLM(str(tiny_model_dir), dtype="float32", speculative_config=spec)
    draft = llm.engine.drafter.model
    assert isinstance(draft, TrimmedHeadLM)
    assert draft.kept.tolist() == frequent_tokens(llm.tokenizer, 5, TINY_VOCAB).tolist()
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected


def test_the_frequency_text_leaves_out_the_bench_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The text the table counts (the default amount) shares no run of text with any bench
    prompt set; an example that does is skipped."""
    bench = BenchFilter(bench_texts())
    texts = list(frequency_texts())
    assert sum(map(len, texts)) >= trimmed_head.FREQUENCY_CHARS
    assert not any(bench.touches(Example("t", "", text)) for text in texts)
    from specdecode.corpus.prompts import load_prompts

    leaked = load_prompts(["chat"], 1)[0].messages[-1]["content"]
    fake = [Example("leak", "hi", "Sure: " + leaked), Example("ok", "hi", "a fine answer")]
    monkeypatch.setattr(trimmed_head, "sharegpt_examples", lambda: iter(fake))
    monkeypatch.setattr(trimmed_head, "stdlib_code_examples", lambda: iter([]))
    assert list(frequency_texts(10)) == ["a fine answer"]
