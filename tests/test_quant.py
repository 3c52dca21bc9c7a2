"""Quantized weight formats: each module against the dense reference, row independence, errors,
and speculative greedy == plain greedy on a model in each format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spec_cases import GREEDY, PROMPTS

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.llm import LLM
from specdecode.model.gguf_linear import GgufLinear
from specdecode.model.linear import Bf16Linear, make_linear
from specdecode.model.loading import load_model
from specdecode.model.quant import (
    Int4Linear,
    Int8DynamicLinear,
    int4_group,
    parse_quantization,
)

FORMATS = ["int8", "int4", "q4_0"]


def _weights(out: int = 96, inp: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) * 0.05, torch.randn(out, generator=gen)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(
    ("quantization", "bound"), [("int8", 0.03), ("int4", 0.15), ("q4_0", 0.15), ("q8_0", 0.03)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formats_approximate_the_dense_product(
    quantization: str, bound: float, dtype: torch.dtype
) -> None:
    weight, bias = _weights()
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    module = make_linear(weight.to(dtype), bias.to(dtype), quantization)
    got = module(x.to(dtype))
    assert got.shape == (2, 5, 96) and got.dtype == dtype
    want = F.linear(x, weight, bias)
    assert _relative_error(got, want) < bound
    # and it is much closer to the weight it says it holds
    closer = F.linear(x, module.dequantized(), bias)
    assert _relative_error(got, closer) < bound / 3


def test_int8_weights_round_to_the_nearest_step() -> None:
    weight, _ = _weights()
    module = Int8DynamicLinear(weight)
    step = weight.abs().amax(1, keepdim=True) / 127  # one scale per output channel
    assert ((module.dequantized() - weight).abs() <= step / 2 + 1e-6).all()


def test_int4_weights_round_to_the_nearest_step_of_their_group() -> None:
    weight, _ = _weights(out=32, inp=256)
    module = Int4Linear(weight)
    assert module.group == 128
    groups = weight.view(32, 2, 128)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    error = (module.dequantized().view(32, 2, 128) - groups).abs()
    assert (error <= step / 2 + 1e-3 * step.max()).all()


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("rows", [9, 65])
def test_a_row_does_not_depend_on_the_other_rows_of_the_pass(quantization: str, rows: int) -> None:
    """What verification needs: each of K + 1 tokens gets what a 1-token step would give it."""
    weight, bias = _weights()
    module = make_linear(weight, bias, quantization)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))
    x[4] *= 50  # an outlier token: with a per-pass activation scale it would move every row
    alone = torch.cat([module(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(module(x), alone)


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [(q, d) for q in FORMATS for d in ["float32", "bfloat16"]] + [(None, "bfloat16")],
)
def test_a_pass_over_k_tokens_equals_k_decode_steps_bit_for_bit(
    tiny_model_dir: Path, quantization: str | None, dtype: str
) -> None:
    """Row-exact projections + per-query attention: the whole model is exact across passes,
    for each row of a batch whose rows have different lengths. bf16 without quantization is
    exact too (the native bf16 kernel)."""
    model = load_model(tiny_model_dir, dtype, quantization=quantization)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 17, 42, 99, 7, 8, 9]] * 2)  # [2, 12]
    cache = model.new_cache(2, 32)
    model(ids[:, :6], AttentionMetadata.prefill([6, 6], "cpu"), cache)
    cache.truncate([6, 4])  # rows of different lengths

    def decode(tokens: torch.Tensor) -> torch.Tensor:  # [2, T] at each row's length
        width = [tokens.shape[1]] * 2
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, cache.lengths, width, "cpu")
        return model(tokens, meta, cache)[0]

    together = decode(ids[:, 6:11])  # [2, 5, V]
    cache.truncate([6, 4])
    steps = [decode(ids[:, 6 + i : 7 + i]) for i in range(5)]
    assert torch.equal(together, torch.cat(steps, 1))


def test_quantization_names_and_errors() -> None:
    assert parse_quantization(None) is None and parse_quantization("none") is None
    assert parse_quantization("int8") == "int8"
    assert parse_quantization("q4_0") == "q4_0"
    allowed = "allowed: auto, none, int8, int4, gguf, q4_0, q4_1, q5_0, q5_1, q8_0"
    with pytest.raises(ValueError, match=f"unknown quantization .fp8.; {allowed}"):
        parse_quantization("fp8")
    assert int4_group(256) == 128 and int4_group(64) == 64 and int4_group(96) == 32
    with pytest.raises(ValueError, match="int4 needs in_features divisible by 32, got 100"):
        int4_group(100)
    with pytest.raises(ValueError, match="'int8' has CPU kernels only; the weights are on meta"):
        Int8DynamicLinear(torch.empty(4, 32, device="meta"))
    with pytest.raises(ValueError, match="'q4_0' has CPU kernels only; the weights are on meta"):
        make_linear(torch.empty(4, 32, device="meta"), quantization="q4_0")


# --- whole models ---------------------------------------------------------------------------


# (quantization, dtype): each quantized format, and bf16 on the native bf16 kernel
MODEL_FORMATS = [("int8", "float32"), ("int4", "float32"), ("q4_0", "bfloat16"), (None, "bfloat16")]


@pytest.fixture(scope="module", params=MODEL_FORMATS, ids=["int8", "int4", "q4_0", "bf16"])
def quantized(request: pytest.FixtureRequest, tiny_model_dir: Path) -> tuple[str | None, LLM]:
    quantization, dtype = request.param
    return quantization, LLM(str(tiny_model_dir), dtype=dtype, quantization=quantization)


def test_quantized_model_stays_close_to_the_dense_one(
    quantized: tuple[str | None, LLM], tiny_model_dir: Path
) -> None:
    quantization, llm = quantized
    dense = LLM(str(tiny_model_dir), dtype="float32").model
    assert llm.model.quantization == quantization
    # int8 under int8 and int4; the block type under a requantized format
    head = {None: Bf16Linear, "q4_0": GgufLinear}.get(quantization, Int8DynamicLinear)
    assert isinstance(llm.model.lm_head, head)
    tokens = torch.tensor([PROMPTS[1]["prompt_token_ids"]])
    meta = AttentionMetadata.prefill([tokens.shape[1]], "cpu")
    want, _ = dense(tokens, meta, dense.new_cache(1, 64))
    got, _ = llm.model(tokens, meta, llm.model.new_cache(1, 64))
    cosine = F.cosine_similarity(got.float().flatten(), want.flatten(), dim=0)
    assert cosine > {"int8": 0.999, "int4": 0.9, "q4_0": 0.9, None: 0.999}[quantization], cosine


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_equals_plain_in_each_format(
    quantized: tuple[str | None, LLM], tiny_model_dir: Path, method: str
) -> None:
    _, plain = quantized
    expected = [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]
    config = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(tiny_model_dir), "num_speculative_tokens": 3, "draft_length": "fixed"}
    )
    spec = plain.with_speculative_config(config)
    assert [list(o.token_ids) for o in spec.generate(PROMPTS, GREEDY)] == expected
    # one request at a time against plain one at a time: a batch's prefill pads rows to one
    # length, which may round a bf16 prompt differently (losslessness is per batch)
    for prompt in PROMPTS:
        want = list(plain.generate(prompt, GREEDY)[0].token_ids)
        assert list(spec.generate(prompt, GREEDY)[0].token_ids) == want
    assert spec.spec_metrics.num_accepted_tokens > 0


def test_draft_model_takes_the_target_format_unless_told(tiny_model_dir: Path) -> None:
    target = LLM(str(tiny_model_dir), dtype="float32", quantization="int8")
    inherit = {"model": str(tiny_model_dir), "num_speculative_tokens": 2}
    same = target.with_speculative_config(inherit)
    assert same.draft_model is not None and same.draft_model.quantization == "int8"
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 2, "quantization": "int4"}
    other = target.with_speculative_config(config)
    assert other.draft_model is not None and other.draft_model.quantization == "int4"
    dense = target.with_speculative_config({**config, "quantization": "none"})
    assert dense.draft_model is not None and dense.draft_model.quantization is None
    assert target.with_speculative_config(inherit).draft_model is same.draft_model  # loaded once


def test_a_draft_model_requantized_to_4_bits_speculates_exactly(tiny_model_dir: Path) -> None:
    """A draft in "q4_0" under a bf16 target: every projection and the head in Q4_0 blocks,
    greedy output that of plain decoding."""
    plain = LLM(str(tiny_model_dir), dtype="bfloat16")
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 3, "quantization": "q4_0"}
    spec = plain.with_speculative_config(config)
    draft = spec.draft_model
    assert draft is not None and draft.quantization == "q4_0"
    blocks = [m for m in draft.modules() if isinstance(m, GgufLinear)]
    assert len(blocks) == 4 * draft.config.num_layers + 1  # qkv, o, gate|up, down + head
    assert {layout.bits for m in blocks for layout, _, _ in m.layouts} == {4}
    for prompt in PROMPTS:
        want = list(plain.generate(prompt, GREEDY)[0].token_ids)
        assert list(spec.generate(prompt, GREEDY)[0].token_ids) == want


def test_bad_quantization_is_refused_before_loading(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(str(tiny_model_dir), quantization="int3")
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 2, "quantization": "q4"}
    with pytest.raises(ValueError, match="unknown quantization 'q4'"):
        LLM(str(tiny_model_dir), speculative_config=config)
    with pytest.raises(ValueError, match="'q4_0' runs with dtype bfloat16 or float32, not"):
        load_model(tiny_model_dir, "float16", quantization="q4_0")
