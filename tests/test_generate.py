"""Plain decoding through `LLM`: greedy parity with HF, batching, stops, seeds, streaming."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode.engine.output import OutputProcessor, held_back
from specdecode.engine.request import Request
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32")


def _hf_greedy(model_dir: Path, prompt_ids: list[int], max_new: int, **kwargs) -> list[int]:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt_ids]),
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_matches_hf_on_tiny_model(tiny_llm: LLM, tiny_model_dir: Path) -> None:
    prompt = {"prompt_token_ids": [5, 17, 42, 99, 3, 250]}
    (out,) = tiny_llm.generate(prompt, GREEDY)
    expected = _hf_greedy(tiny_model_dir, prompt["prompt_token_ids"], 24, min_new_tokens=24)
    assert list(out.token_ids) == expected
    assert out.outputs[0].finish_reason == "length"


def test_batch_of_different_lengths_equals_each_alone(tiny_llm: LLM) -> None:
    prompts = [
        {"prompt_token_ids": [1, 2, 3]},
        {"prompt_token_ids": list(range(10, 40))},
        {"prompt_token_ids": [7]},
        {"prompt_token_ids": list(range(100, 112))},
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 5, 12, 16)
    ]
    batched = tiny_llm.generate(prompts, params)
    for prompt, param, got in zip(prompts, params, batched, strict=True):
        (alone,) = tiny_llm.generate(prompt, param)
        assert got.token_ids == alone.token_ids
        assert len(got.token_ids) == param.max_tokens


def test_same_seed_same_sample_and_different_seeds_differ(tiny_llm: LLM) -> None:
    prompt = {"prompt_token_ids": [3, 4, 5]}

    def run(seed: int) -> tuple[int, ...]:
        params = SamplingParams(temperature=1.5, max_tokens=20, seed=seed, ignore_eos=True)
        return tiny_llm.generate(prompt, params)[0].token_ids

    assert run(7) == run(7)
    assert len({run(s) for s in range(5)}) > 1


def test_stream_yields_growing_text_equal_to_final(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = list(tiny_llm.stream("hello world", params))
    texts = [o.text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert (outs[-1].finished and not outs[0].finished) or len(outs) == 1
    (final,) = tiny_llm.generate("hello world", params)
    assert outs[-1].text == final.text and outs[-1].token_ids == final.token_ids


def test_metrics_are_counted(tiny_llm: LLM) -> None:
    (out,) = tiny_llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, GREEDY)
    m = out.metrics
    assert m is not None
    assert (m.num_prompt_tokens, m.num_generated_tokens) == (4, 24)
    assert 0 < m.time_to_first_token_s <= m.elapsed_s
    assert m.tokens_per_s == pytest.approx(24 / m.elapsed_s)


def test_prompt_longer_than_context_is_refused(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt has 300 tokens but the model's context is 256"):
        tiny_llm.generate({"prompt_token_ids": [1] * 300}, GREEDY)


def test_generation_stops_at_context_end(tiny_llm: LLM) -> None:
    (out,) = tiny_llm.generate({"prompt_token_ids": [1] * 250}, GREEDY)
    assert len(out.token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_bad_prompts_are_refused(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate({"prompt_token_ids": [1, 100000]}, GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="a prompt must be a str"):
        tiny_llm.generate([3.5], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        tiny_llm.generate(["a", "b"], [GREEDY] * 3)


# --- Request + OutputProcessor: EOS, stop strings, token limits (fed by hand, no model) -------


class _Fed:
    """A request and the output processor, fed tokens by hand as a step would."""

    def __init__(self, llm: LLM, **kwargs) -> None:
        params = SamplingParams(**kwargs)
        self.req = Request("0", None, [1, 2], params, llm.tokenizer.eos_token_ids, 256)
        self.outputs = OutputProcessor(llm.tokenizer)
        self.outputs.add(self.req)

    def append(self, tokens: list[int]) -> str:
        return self.outputs.process(self.req, self.req.append(tokens))

    @property
    def text(self) -> str:
        return self.outputs.output(self.req).text


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_eos_inside_a_multi_token_step_stops_there(tiny_llm: LLM) -> None:
    eos = tiny_llm.tokenizer.eos_token_ids[0]
    fed = _Fed(tiny_llm, max_tokens=50)
    text = fed.append([*_ids(tiny_llm, "ab"), eos, *_ids(tiny_llm, "cd")])
    assert text == "ab" and fed.text == "ab"
    assert fed.req.output_ids == [*_ids(tiny_llm, "ab"), eos]
    assert (fed.req.finish_reason, fed.req.stop_reason) == ("stop", eos)


def test_ignore_eos_keeps_going(tiny_llm: LLM) -> None:
    eos = tiny_llm.tokenizer.eos_token_ids[0]
    fed = _Fed(tiny_llm, max_tokens=50, ignore_eos=True)
    fed.append([eos, *_ids(tiny_llm, "x")])
    assert not fed.req.finished and len(fed.req.output_ids) == 2


def test_max_tokens_never_exceeded_by_a_multi_token_step(tiny_llm: LLM) -> None:
    fed = _Fed(tiny_llm, max_tokens=3)
    fed.append(_ids(tiny_llm, "abcdef"))
    assert fed.req.output_ids == _ids(tiny_llm, "abc") and fed.req.finish_reason == "length"
    assert fed.text == "abc"


def test_stop_string_split_across_tokens_is_held_back_and_cut(tiny_llm: LLM) -> None:
    fed = _Fed(tiny_llm, max_tokens=50, stop=["END"])
    released = [fed.append([t]) for t in _ids(tiny_llm, "abc EN")]
    assert "".join(released) == "abc " and not fed.req.finished  # "EN" may begin "END"
    assert fed.append(_ids(tiny_llm, "Dxyz")) == ""
    assert fed.text == "abc " and (fed.req.finish_reason, fed.req.stop_reason) == ("stop", "END")
    assert fed.req.output_ids == _ids(tiny_llm, "abc END")  # the tokens after it are dropped


def test_stop_string_inside_one_step_keeps_the_text_before_it(tiny_llm: LLM) -> None:
    fed = _Fed(tiny_llm, max_tokens=50, stop=["END"])
    assert fed.append(_ids(tiny_llm, "abENDcd")) == "ab"
    assert fed.text == "ab" and fed.req.output_ids == _ids(tiny_llm, "abEND")


def test_false_stop_prefix_is_released_at_the_end(tiny_llm: LLM) -> None:
    fed = _Fed(tiny_llm, max_tokens=4, stop=["ENDING"])
    fed.append(_ids(tiny_llm, "aEND"))
    assert fed.text == "aEND" and fed.req.finish_reason == "length"


def test_held_back_examples() -> None:
    assert held_back("abc<|e", ["<|end|>"]) == 3
    assert held_back("abc", ["<|end|>"]) == 0
    assert held_back("xEN", ["END", "NO"]) == 2
