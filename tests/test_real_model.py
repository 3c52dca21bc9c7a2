"""Integration tests on the real SmolLM2-135M-Instruct (pulled from PyPI, converted once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode.bench.parity import argmax_agreement, llamacpp_logits, our_logits
from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.corpus.prompts import load_prompts
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(arr):\n",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm32(smollm2_dir: Path) -> LLM:
    return LLM(model="smollm2-135m", dtype="float32", quantization="none")  # HF's weights


def test_logits_match_hf_on_real_weights(llm32: LLM, hf_smollm2: torch.nn.Module) -> None:
    ids = llm32.tokenizer.encode(PROMPTS[0] + " was long and complicated.")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = hf_smollm2(tokens).logits
    cache = llm32.model.new_cache(1, 64)
    logits, _ = llm32.model(tokens, AttentionMetadata.prefill([len(ids)], "cpu"), cache)
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-3)


def test_conversion_matches_hf_reading_the_gguf(
    smollm2_dir: Path, smollm2_gguf_alone: Path
) -> None:
    """Independent check of our GGUF conversion (dequantization, q/k un-permutation, names)."""
    ref = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_alone.parent, gguf_file=smollm2_gguf_alone.name, dtype=torch.float32
    ).eval()
    ours = load_model(smollm2_dir, dtype="float32")
    tokens = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 2365, 28]])
    with torch.no_grad():
        expected = ref(tokens).logits
    got, _ = ours(
        tokens, AttentionMetadata.prefill([tokens.shape[1]], "cpu"), ours.new_cache(1, 16)
    )
    # Our cache stores bf16 weights (rounded from the dequantized Q4 values), so allow that.
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_64_tokens_equal_hf_token_for_token(llm32: LLM, hf_smollm2: torch.nn.Module) -> None:
    # Both stop at the same EOS ids (generation_config.json); HF's min_new_tokens would instead
    # mask the EOS logits and so change the greedy path.
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outs = llm32.generate(PROMPTS, params)  # one batch of prompts with different lengths
    lengths = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm32.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)
        assert list(out.token_ids) == ref[0, len(ids) :].tolist(), prompt
        lengths.append(len(out.token_ids))
    assert sum(lengths) >= 3 * 64  # most prompts run the full 64 tokens


def test_chat_answers_coherently() -> None:
    # bf16 weights and activations: with int8 activations (gguf, the default format, and
    # llama.cpp alike) this 135M model answers "L'Étoile, la ..." to this prompt
    assert LLM(model="smollm2-135m").model.quantization == "gguf"
    llm = LLM(model="smollm2-135m", dtype="bfloat16", quantization="none")
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=40),
    )
    assert "Paris" in out.text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, not by the limit


def test_draft_model_speculative_greedy_equals_plain_on_real_model(llm32: LLM) -> None:
    config = {
        "model": "smollm2-135m",
        "num_speculative_tokens": 4,
        "draft_length": "fixed",
    }  # draft = target
    spec = LLM(
        model="smollm2-135m", dtype="float32", quantization="none", speculative_config=config
    )
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain_out = llm32.generate(PROMPTS[:2], params)
    spec_out = spec.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain_out]
    assert spec.spec_metrics.acceptance_rate >= 0.98


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "num_speculative_tokens": 6},
        {"method": "ngram", "num_speculative_tokens": 8, "tree_width": 3, "tree_depth": 4},
        {
            "model": "smollm2-135m",
            "num_speculative_tokens": 8,
            "tree_width": 3,
            "tree_depth": 3,
            "draft_length": "fixed",
        },
    ],
    ids=["ngram", "ngram_tree", "draft_model_tree"],
)
def test_ngram_and_tree_speculation_greedy_equals_plain_on_real_model(llm32: LLM, config) -> None:
    """fp32 chains and token trees on the real model, batched: the same tokens as plain
    decoding; lookup hits on the echo prompt."""
    spec = llm32.with_speculative_config(config)
    text = "The cat sat on the mat. The cat ran to the door. The cat sat on the "
    prompts = [*PROMPTS[:2], f"Repeat this text exactly: {text}\nRepeated: {text[:30]}"]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain_out = llm32.generate(prompts, params)
    spec_out = spec.generate(prompts, params)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain_out]
    assert spec.spec_metrics.num_accepted_tokens > 0
    assert (spec.spec_metrics.num_tree_drafts > 0) == ("tree_width" in config)


# Teacher-forced top-1 agreement with fp32 that each format must keep on this text (measured:
# 0.88 for int8, 0.74 for int4 over its 50 positions;
# docs/history/formats-and-kernels-issues-5-17.md has the figures on the bench prompts,
# where the model is more certain).
# Share of positions where quantization="gguf" (fp32 activations) and llama.cpp agree on the
# next token over the test's bench prompts (the goal was 0.99; measured 0.967, int8 0.878;
# llama.cpp and we each agree with the exact fp32 model on ~0.977:
# docs/history/formats-and-kernels-issues-5-17.md).
PARITY = 0.95
TOP1_AGREEMENT = {"int8": 0.8, "int4": 0.65, "gguf": 0.9}


@pytest.mark.parametrize(
    "quantization", ["int8", pytest.param("int4", marks=pytest.mark.slow), "gguf"]
)
def test_quantized_real_model_tracks_fp32_and_speculates_exactly(
    llm32: LLM, quantization: str
) -> None:
    llm = LLM(model="smollm2-135m", dtype="float32", quantization=quantization)
    text = " ".join(PROMPTS) + " The end of the story was not what anyone expected."
    ids = llm32.tokenizer.encode(text)
    tokens, meta = torch.tensor([ids]), AttentionMetadata.prefill([len(ids)], "cpu")
    want, _ = llm32.model(tokens, meta, llm32.model.new_cache(1, len(ids)))
    got, _ = llm.model(tokens, meta, llm.model.new_cache(1, len(ids)))
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= TOP1_AGREEMENT[quantization], agreement
    # speculation is exact relative to the quantized target, whatever that target is
    spec = llm.with_speculative_config({"method": "ngram", "num_speculative_tokens": 6})
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain_out = llm.generate(PROMPTS, params)
    spec_out = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain_out]


def test_gguf_agrees_with_llamacpp_on_the_same_file(smollm2_gguf: Path) -> None:
    """Teacher-forced next-token argmax of quantization="gguf" vs llama.cpp reading the same
    blocks (docs/history/formats-and-kernels-issues-5-17.md has the figures on the bench
    prompts and the 1.5B)."""
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python==0.3.36 (not in make test)")
    llm = LLM(model="smollm2-135m", dtype="float32", quantization="gguf")
    prompts = load_prompts(["code", "chat", "summarize", "qa"], 2)  # ~1,500 positions
    sequences = [llm.chat_prompt(list(p.messages))["prompt_token_ids"] for p in prompts]
    ours = our_logits(llm.model, sequences)
    agree, total = argmax_agreement(ours, llamacpp_logits(smollm2_gguf, sequences))
    assert agree / total >= PARITY, (agree, total)
