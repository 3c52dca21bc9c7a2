"""Penalties, logit biases and logprobs: plain decoding matches a naive reference (Hugging
Face's model, one full forward per token, the penalties written out by hand), and every
drafter (chains and trees, alone and batched) gives the same tokens and the same
log-probabilities as plain decoding: close in fp32, bit for bit in int8."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from drafter_examples import example_config
from spec_cases import PROMPTS

from specdecode.drafters.registry import DRAFTERS
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.types import RequestOutput

TOP = 3
ADJUSTED = SamplingParams(
    temperature=0.0,
    max_tokens=24,
    ignore_eos=True,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.3,
    logit_bias={7: 2.0, 42: -3.0},
    logprobs=TOP,
)
TREE = {"method": "draft_model", "num_speculative_tokens": 4, "tree_width": 2, "tree_depth": 3}


def _reference(model_dir: Path, prompt: list[int], params: SamplingParams) -> tuple[list, list]:
    """Greedy tokens and raw log-softmax rows, one full Hugging Face forward per token, the
    bias and penalties applied by hand as their definitions say."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out: list[int] = []
    rows = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()  # [V]
        rows.append(torch.log_softmax(logits, -1))
        for token, bias in params.logit_bias:
            logits[token] += bias
        for token in set(prompt) | set(out):
            value = logits[token]
            logits[token] = (
                value / params.repetition_penalty
                if value > 0
                else value * params.repetition_penalty
            )
        for token, count in Counter(out).items():
            logits[token] -= params.frequency_penalty * count + params.presence_penalty
        out.append(int(logits.argmax()))
    return out, rows


def _generate(llm: LLM, params: SamplingParams = ADJUSTED) -> list[RequestOutput]:
    return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir: Path) -> list[RequestOutput]:
    return _generate(LLM(model=str(tiny_model_dir), dtype="float32"))


def test_plain_decoding_matches_the_naive_reference(
    tiny_model_dir: Path, plain_outputs: list[RequestOutput]
) -> None:
    unadjusted = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    changed = 0
    for prompt, got, free in zip(PROMPTS, plain_outputs, _generate(plain, unadjusted), strict=True):
        tokens, rows = _reference(tiny_model_dir, prompt["prompt_token_ids"], ADJUSTED)
        assert list(got.token_ids) == tokens
        changed += list(free.token_ids) != tokens
        logprobs = got.outputs[0].logprobs
        assert free.outputs[0].logprobs is None  # not asked for
        assert logprobs is not None and len(logprobs) == len(tokens)
        for entry, token, row in zip(logprobs, tokens, rows, strict=True):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
            best = torch.topk(row, TOP)
            assert [t for t, _ in entry.top] == best.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert changed  # the penalties and the bias change what is generated


def _same_logprobs(got: list[RequestOutput], want: list[RequestOutput], exact: bool) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            if exact:
                assert x == y
            else:
                assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_every_drafter_keeps_penalties_and_logprobs_exact(
    tiny_model_dir: Path, plain_outputs: list[RequestOutput], method: str
) -> None:
    config = example_config(method, tiny_model_dir)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    _same_logprobs(_generate(llm), plain_outputs, exact=False)
    (alone,) = llm.generate(PROMPTS[1], ADJUSTED)
    _same_logprobs([alone], plain_outputs[1:2], exact=False)


def test_trees_keep_them_exact_and_int8_bit_for_bit(tiny_model_dir: Path) -> None:
    tree = {**TREE, "model": str(tiny_model_dir)}
    fp32 = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=tree)
    plain32 = LLM(model=str(tiny_model_dir), dtype="float32")
    _same_logprobs(_generate(fp32), _generate(plain32), exact=False)
    int8 = {"dtype": "bfloat16", "quantization": "int8"}
    plain8 = _generate(LLM(model=str(tiny_model_dir), **int8))
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    for config in (tree, ngram):
        spec = LLM(model=str(tiny_model_dir), speculative_config=config, **int8)
        _same_logprobs(_generate(spec), plain8, exact=True)


def test_stop_strings_cut_the_logprobs_with_the_tokens(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    free = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=20, logprobs=0))[0]
    text = free.text
    stop = text[len(text) // 2 :][:2]
    assert stop
    cut = llm.generate(
        "abc", SamplingParams(temperature=0.0, max_tokens=20, logprobs=0, stop=stop)
    )[0]
    logprobs = cut.outputs[0].logprobs
    assert len(logprobs) == len(cut.token_ids) < len(free.token_ids)
    assert all(entry.top == () for entry in logprobs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number > 0"),
        ({"logit_bias": {5: 101}}, r"\[-100, 100\]"),
        ({"logit_bias": {"a": 1}}, "logit_bias must map token ids"),
        ({"logit_bias": {-1: 1}}, "token ids >= 0"),
        ({"logprobs": 21}, r"logprobs must be None or an int in 0\.\.20"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_bad_values_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        SamplingParams(**fields)


def test_a_bias_outside_the_vocabulary_is_refused(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    with pytest.raises(UserError, match="logit_bias names token 300, outside the vocabulary"):
        llm.generate("abc", SamplingParams(logit_bias={300: 1.0}))
