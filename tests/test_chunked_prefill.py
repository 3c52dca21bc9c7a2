"""Chunked prefill: a long prompt that arrives while others decode is prefilled a chunk per
step (no larger than what the running rows verify), the running rows get a token every step
meanwhile, and every request's output is the one it gets alone; chunked equals one-pass
prefill (fp32 tokens; int8 bit for bit, logprobs included). Prompts admitted together are
prefilled in one pass (within the step's token budget), each as it is alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build_tiny_eagle3_head

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.engine.scheduler import ONE_PASS_PREFILL, SchedulerConfig
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

SHORT = [{"prompt_token_ids": [5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 1, 9, 1]}]
LONG = {"prompt_token_ids": [(i * 7) % 250 for i in range(150)]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
SHORT_PARAMS = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, logprobs=1)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _run(llm: LLM) -> tuple[dict[str, object], list[int], list[int]]:
    """Two short requests decode; after two steps the long one arrives. Returns the outputs
    by request id, and for each step the long prompt spent prefilling: its computed tokens
    after the step, and how many of the short requests got tokens in it."""
    engine = llm.engine
    short = [llm.make_request(p, SHORT_PARAMS) for p in SHORT]
    for req in short:
        engine.add(req)
    outputs: dict[str, object] = {}
    for _ in range(2):
        for event in engine.step():
            outputs[event.request.request_id] = event.output
    long = llm.make_request(LONG, PARAMS)
    engine.add(long)
    computed, served = [], []
    while engine.has_unfinished():
        prefilling = long.prefilling
        before = [len(r.output_ids) for r in short]
        for event in engine.step():
            outputs[event.request.request_id] = event.output
        if prefilling:
            computed.append(long.num_computed_tokens)
            served.append(sum(len(r.output_ids) > n for r, n in zip(short, before, strict=True)))
    return {r.request_id: outputs[r.request_id] for r in [*short, long]}, computed, served


@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_a_long_prompt_is_prefilled_in_chunks_beside_running_rows(
    tiny_model_dir: Path, config
) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    outs, computed, served = _run(llm)
    chunks = [b - a for a, b in zip([0, *computed], computed, strict=False) if b > a]
    assert len(chunks) > 1  # the prompt took several steps
    k = 0 if config is None else NGRAM["num_speculative_tokens"]
    assert max(chunks[:-1]) <= max(BLOCK_TOKENS, 2 * (1 + k))  # no more than the rows verify
    assert served == [2] * len(served)  # both short rows got tokens every step meanwhile
    alone = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    for prompt, params, out in zip(
        [*SHORT, LONG], [SHORT_PARAMS, SHORT_PARAMS, PARAMS], outs.values(), strict=True
    ):
        (want,) = alone.generate(prompt, params)
        assert out.token_ids == want.token_ids


def test_chunked_equals_one_pass_bit_for_bit_in_int8(tiny_model_dir: Path) -> None:
    int8 = {"dtype": "bfloat16", "quantization": "int8"}
    chunked = LLM(model=str(tiny_model_dir), **int8)
    chunked.set_scheduler(SchedulerConfig(prefix_cache_tokens=0))
    outs, computed, _ = _run(chunked)
    assert len({c for c in computed if c < len(LONG["prompt_token_ids"])}) > 1
    whole = LLM(model=str(tiny_model_dir), **int8)
    whole.set_scheduler(SchedulerConfig(prefix_cache_tokens=0, max_num_batched_tokens=8192))
    (want,) = whole.generate(LONG, PARAMS)  # alone: one pass, per-token attention
    got = list(outs.values())[-1]
    assert got.token_ids == want.token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs


def _prefill_passes(llm: LLM) -> list[tuple[int, ...]]:
    """Spy on `llm`'s target: the rows' new-token counts of each pass that starts a prompt
    (a pass with a row at slot 0)."""
    model = llm.engine.model
    forward = model.forward
    passes: list[tuple[int, ...]] = []

    def spy(tokens, meta: AttentionMetadata, *args, **kwargs):
        if 0 in meta.starts:
            passes.append(meta.num_new)
        return forward(tokens, meta, *args, **kwargs)

    model.forward = spy
    return passes


PROMPTS = [{"prompt_token_ids": [(i * 3 + n) % 250 for i in range(n)]} for n in (20, 7, 30, 12)]


@pytest.mark.parametrize("one_pass", [False, True], ids=["exact", "one-pass-prefill"])
def test_prompts_admitted_together_share_a_prefill_pass(tiny_model_dir: Path, one_pass) -> None:
    """Four prompts arrive together: exact prefill (per-token attention, the default) runs
    those admitted together in one pass (within max_num_batched_tokens), each row
    giving the logprobs it gets alone, bit for bit (int8); ONE_PASS_PREFILL's batched
    attention keeps one prompt per pass."""
    int8 = {"dtype": "bfloat16", "quantization": "int8"}
    budget = 40
    config = (
        SchedulerConfig(prefix_cache_tokens=0, chunked_prefill=False, max_num_batched_tokens=budget)
        if one_pass
        else SchedulerConfig(prefix_cache_tokens=0, max_num_batched_tokens=budget)
    )
    together = LLM(model=str(tiny_model_dir), scheduler=config, **int8)
    passes = _prefill_passes(together)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = together.generate(PROMPTS, [params] * len(PROMPTS))
    if one_pass:
        assert passes == [(20,), (7,), (30,), (12,)]
    else:  # with their first steps' verification tokens, 20 + 7 + 30 > 40: the third waits
        assert passes[0] == (20, 7) and all(sum(p) <= budget for p in passes)
    alone = LLM(model=str(tiny_model_dir), scheduler=config, **int8)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        (want,) = alone.generate(prompt, params)
        assert out.token_ids == want.token_ids
        assert out.outputs[0].logprobs == want.outputs[0].logprobs


def test_prompts_that_share_a_block_run_one_after_another(tiny_model_dir: Path) -> None:
    """Under the prefix cache, a prompt whose first block another prompt of the pass holds
    waits for its pass and gets the hit; one that shares nothing joins the next pass."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    passes = _prefill_passes(llm)
    shared = [(i * 5) % 250 for i in range(2 * BLOCK_TOKENS)]
    prompts = [
        {"prompt_token_ids": [*shared, 40, 41]},
        {"prompt_token_ids": [*shared, 50]},
        {"prompt_token_ids": [7] * 20},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, [params] * 3)
    assert outs[1].metrics.num_cached_tokens == 2 * BLOCK_TOKENS
    assert passes == [(2 * BLOCK_TOKENS + 2,), (1, 20)]


def test_prompts_that_share_a_block_share_a_pass_when_no_hit_can_load(
    tiny_model_dir: Path,
) -> None:
    """A drafter that reads the target's states at every prompt token (an EAGLE-3 head's
    catch-up) never starts a prompt from the prefix cache, so prompts sharing a first block
    have nothing to wait for: they prefill in one pass, each giving plain decoding's output."""
    head = build_tiny_eagle3_head(tiny_model_dir, tiny_model_dir / "eagle3-head-prefill")
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    passes = _prefill_passes(llm)
    shared = [(i * 5) % 250 for i in range(2 * BLOCK_TOKENS)]
    prompts = [{"prompt_token_ids": [*shared, 40, 41]}, {"prompt_token_ids": [*shared, 50]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, [params] * 2)
    assert passes == [(2 * BLOCK_TOKENS + 2, 2 * BLOCK_TOKENS + 1)]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0]
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]


@pytest.mark.real_model
def test_smollm2_chunks_and_prefix_hits_equal_one_cold_pass_bit_for_bit(smollm2_dir: Path) -> None:
    """In the default format (gguf, bf16 activations), where a batched prefill's rounding
    depends on the pass: a prompt split into chunks, served partly from the prefix cache, or
    prefilled in one pass with other prompts, gives the logprobs of the one-pass cold prefill,
    bit for bit."""
    text = " ".join(f"item {i} is {i * i}." for i in range(36))  # ~250 tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    cold = LLM(model=str(smollm2_dir), scheduler=SchedulerConfig(prefix_cache_tokens=0))
    (want,) = cold.generate(text, params)
    warm = cold.with_speculative_config(None)
    warm.set_scheduler(SchedulerConfig(prefix_cache_tokens=4096))
    warm.generate(text[: len(text) // 2], params)  # leaves the prompt's first half cached
    (hit,) = warm.generate(text, params)
    assert hit.metrics.num_cached_tokens > 0
    assert hit.outputs[0].logprobs == want.outputs[0].logprobs
    chunked = cold.with_speculative_config(None)
    chunked.set_scheduler(SchedulerConfig(prefix_cache_tokens=0, max_num_batched_tokens=64))
    engine = chunked.engine
    busy = chunked.make_request("hello", SamplingParams(max_tokens=60, ignore_eos=True))
    engine.add(busy)
    engine.step()  # a row decodes: the long prompt is chunked beside it
    request = chunked.make_request(text, params)
    engine.add(request)
    steps = 0
    while request.prefilling:
        engine.step()
        steps += 1
    while not request.finished:
        engine.step()
    assert steps > 1
    assert tuple(request.logprobs) == want.outputs[0].logprobs
    batched = LLM(model=str(smollm2_dir), scheduler=ONE_PASS_PREFILL)
    (fast,) = batched.generate(text, params)
    assert fast.outputs[0].logprobs != want.outputs[0].logprobs  # the test can tell them apart
    texts = ["Name three colours.", text[: len(text) // 4], "def add(a, b):"]
    passes = _prefill_passes(cold)
    together = cold.generate(texts, [params] * 3)
    assert len(passes) == 1 and len(passes[0]) == 3  # one prefill pass for all three
    for prompt, out in zip(texts, together, strict=True):
        (alone,) = cold.generate(prompt, params)
        assert out.outputs[0].logprobs == alone.outputs[0].logprobs
