"""The OpenAI fields past the basics, through the real `openai` client on a real server with
speculation on: `logprobs` / `top_logprobs` (completions and chat, streamed and not) equal
`LLM.generate`'s without speculation; `n` choices, seeded like separate requests; `echo`;
presence / frequency / repetition penalties and `logit_bias` as the engine applies them."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from conftest import build_tiny_model
from server_cases import running_server

from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServeConfig

NAME = "tiny"
PROMPT = "the cat sat on the mat. the cat"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("api_llama"), "llama")


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def base(model_dir: Path):
    spec = LLM(model=str(model_dir), dtype="float32").with_drafters([NGRAM])
    with running_server(spec, ServeConfig(NAME)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, **fields)


def test_completion_logprobs_equal_plain_decoding(client: openai.OpenAI, plain: LLM) -> None:
    (want,) = plain.generate(PROMPT, _greedy(logprobs=2))
    entries = want.outputs[0].logprobs
    decode = plain.tokenizer.decode
    common = {"model": NAME, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    extra = {"ignore_eos": True}
    got = client.completions.create(**common, logprobs=2, extra_body=extra)
    logprobs = got.choices[0].logprobs
    assert got.choices[0].text == want.text
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert logprobs.tokens == [decode([e.token_id], skip_special_tokens=False) for e in entries]
    for top, entry in zip(logprobs.top_logprobs, entries, strict=True):
        assert len(top) >= 2 and top[decode([entry.top[0][0]])] == pytest.approx(entry.top[0][1])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    stream = client.completions.create(**common, logprobs=2, stream=True, extra_body=extra)
    streamed, text = [], ""
    for chunk in stream:
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert text == want.text
    assert streamed == pytest.approx([e.logprob for e in entries], abs=1e-5)


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI, plain: LLM) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    prompt = plain.chat_prompt(messages)
    (want,) = plain.generate(prompt, _greedy(logprobs=3))
    entries = want.outputs[0].logprobs
    common = {"model": NAME, "messages": messages, "max_tokens": TOKENS, "temperature": 0}
    extra = {"ignore_eos": True}
    got = client.chat.completions.create(**common, logprobs=True, top_logprobs=3, extra_body=extra)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert [c.top_logprobs[0].logprob for c in content] == pytest.approx(
        [e.top[0][1] for e in entries], abs=1e-5
    )
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(**common, logprobs=True, stream=True, extra_body=extra)
    streamed = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [c.logprob for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in entries], abs=1e-5)
    plain_answer = client.chat.completions.create(**common, extra_body=extra)
    assert plain_answer.choices[0].logprobs is None


def test_n_choices_are_seeded_like_separate_requests(client: openai.OpenAI) -> None:
    common = {"model": NAME, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 1.0}
    both = client.completions.create(**common, n=2, seed=11)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [client.completions.create(**common, seed=seed).choices[0].text for seed in (11, 12)]
    assert [c.text for c in both.choices] == alone
    assert both.usage.completion_tokens == sum(
        client.completions.create(**common, seed=seed).usage.completion_tokens for seed in (11, 12)
    )
    stream = client.completions.create(**common, n=3, seed=11, stream=True)
    texts = ["", "", ""]
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert texts[:2] == alone and finished == {0, 1, 2}
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_echo_puts_the_prompt_first(client: openai.OpenAI, plain: LLM) -> None:
    (want,) = plain.generate(PROMPT, _greedy())
    common = {"model": NAME, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    extra = {"ignore_eos": True}
    got = client.completions.create(**common, echo=True, extra_body=extra)
    assert got.choices[0].text == PROMPT + want.text
    stream = client.completions.create(**common, echo=True, stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in stream) == PROMPT + want.text
    ids = plain.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(**{**common, "prompt": ids}, echo=True, extra_body=extra)
    assert by_ids.choices[0].text == plain.tokenizer.decode(ids) + want.text


def test_penalties_and_bias_as_the_engine_applies_them(client: openai.OpenAI, plain: LLM) -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.2}
    bias = {plain.tokenizer.encode(" the", add_special_tokens=False)[0]: -100.0}
    (want,) = plain.generate(PROMPT, _greedy(**fields, logit_bias=bias))
    (free,) = plain.generate(PROMPT, _greedy())
    assert want.text != free.text
    got = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        presence_penalty=fields["presence_penalty"],
        frequency_penalty=fields["frequency_penalty"],
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True, "repetition_penalty": fields["repetition_penalty"]},
    )
    assert got.choices[0].text == want.text
