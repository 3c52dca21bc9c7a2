"""Architectures beyond the two the rest of the suite runs (Llama, Qwen2): Llama 3.x's RoPE
scaling, Mistral, Qwen3's q/k head norms, Gemma 2 (soft-capped attention scores and logits,
every second layer sliding) and Gemma 3 (its norms, GeGLU, embedding scale, sliding-window
layers with their own RoPE base, query scale, soft-capping), Phi-3, each a tiny random
Hugging Face model built offline. fp32 logits equal transformers' over 64 tokens, greedy
output is transformers', speculation (ngram, a draft model) gives plain's tokens, in fp32 and
bit for bit in int8 and gguf, and configs we cannot run yet are refused with what is wrong."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, build_tiny_model
from torch import Tensor
from transformers import AutoModelForCausalLM

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.loading import load_model
from specdecode.model.rope import LinearRope, LongRope, RopeScaling, Rotary, Yarn, base_frequencies
from specdecode.model.transformer import Transformer
from specdecode.sampling_params import SamplingParams

VOCAB = TINY_VOCAB
CONTEXT = 256
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# model_type -> the config's own fields beside SIZES
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": True},
    ),
    "mistral": ("mistral", {"rope_theta": 10000.0, "sliding_window": None}),  # untied head
    "qwen3": ("qwen3", {"rope_theta": 10000.0, "head_dim": 32, "tie_word_embeddings": True}),
    # Gemma 3: a window of 16 on layers 0 and 2 (so 64 tokens run far past it), a local RoPE
    # base, linear RoPE scaling on the global layer (4B and larger: factor 8), a query scale
    # other than head_dim's, logit soft-capping (Gemma 2's; Gemma 3 has none), tied head
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_theta": 20000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Gemma 2: Gemma's block without q/k norms; a window of 16 on every second layer (0 and 2,
    # transformers' default), one RoPE base, attention scores soft-capped at 0.5 (the real
    # models' 50 leaves these tiny models' scores of ~1 alone: 0.5 bends them), logits at 5
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": 16,
            "rope_theta": 10000.0,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 5.0,
        },
    ),
    # Phi-3: fused q|k|v and gate|up, LongRoPE past an original context of 64 (factor 256 / 64)
    "phi3": (
        "phi3",
        {
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0],
                "long_factor": [1.0, 1.2, 1.6, 2.4, 3.5, 5.0, 7.0, 9.0],
            },
            "sliding_window": None,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
    ),
}
# the architectures llama.cpp's GGUF files of which we read
GGUF_ARCHITECTURES = ("llama3", "mistral", "qwen3", "gemma2", "gemma3", "phi3")


def build(path: Path, name: str, seed: int = 0) -> Path:
    """A tiny random model of architecture `name` (a key of ARCHITECTURES) in `path`."""
    model_type, fields = ARCHITECTURES[name]
    return build_tiny_model(path, model_type, seed, CONTEXT, **fields)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp(request.param), request.param)


def _tokens(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _assert_steps_give(model: Transformer, tokens: Tensor, want: Tensor, prefill: int) -> None:
    """Prefill tokens[:, :prefill] ([1, T]), then one DECODE step per later token: each
    step's fp32 logits equal want[:, t] ([1, T, V]) within 1e-4."""
    cache = model.new_cache(1, tokens.shape[1])
    model(tokens[:, :prefill], AttentionMetadata.prefill([prefill], "cpu"), cache)
    for t in range(prefill, tokens.shape[1]):
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [t], [1], "cpu")
        step, _ = model(tokens[:, t : t + 1], meta, cache)
        torch.testing.assert_close(step[:, 0], want[:, t], atol=1e-4, rtol=1e-4)


def test_the_config_reads_the_architectures_choices(arch_dir: Path) -> None:
    cfg = ModelConfig.from_folder(arch_dir)
    if cfg.architecture == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32 and not cfg.qkv_bias
    if arch_dir.name.startswith("llama3"):
        assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    if cfg.architecture == "gemma3_text":
        assert cfg.gemma and cfg.qk_norm and cfg.activation == "gelu_tanh"
        assert (cfg.sliding_window, cfg.sliding_layers) == (16, (0, 2))
        assert (cfg.rope_theta, cfg.local_rope_theta) == (20000.0, 100.0)
        assert cfg.rope_scaling == LinearRope(4.0)
        assert cfg.attention_scale == 24**-0.5 and cfg.logit_softcap == 30.0
        assert cfg.attn_softcap is None
    if cfg.architecture == "gemma2":
        assert cfg.gemma and not cfg.qk_norm and cfg.activation == "gelu_tanh"
        assert (cfg.sliding_window, cfg.sliding_layers) == (16, (0, 2))
        assert (cfg.local_rope_theta, cfg.attention_scale) == (None, 24**-0.5)
        assert (cfg.attn_softcap, cfg.logit_softcap) == (0.5, 5.0)
    if cfg.architecture == "phi3":
        assert isinstance(cfg.rope_scaling, LongRope)
        assert cfg.rope_scaling.original_max_position_embeddings == 64
        assert cfg.rope_scaling.attention_factor == pytest.approx((1 + 1 / 3) ** 0.5)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # what convert writes reads back


def test_fp32_logits_equal_transformers_over_64_tokens(arch_dir: Path) -> None:
    """64 tokens, past the llama3 scaling's original context (64 / 4 = 16 tokens' wavelength
    and beyond are scaled), as one prefill and as prefill + one-token steps."""
    ours = load_model(arch_dir, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(arch_dir, dtype=torch.float32).eval()
    tokens = _tokens(1, 64)
    with torch.no_grad():
        want = ref(tokens).logits  # [1, 64, V]
    cache = ours.new_cache(1, 64)
    logits, _ = ours(tokens, AttentionMetadata.prefill([64], "cpu"), cache)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    _assert_steps_give(ours, tokens, want, prefill=40)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_attention_bias_gives_q_k_v_and_o_their_biases(model_type: str, tmp_path: Path) -> None:
    """`attention_bias` (Qwen3's and Llama's config field) puts a bias on q, k, v and o, as
    transformers' layers have them; random biases, so that a missing one shows."""
    path = build_tiny_model(tmp_path, model_type, head_dim=32, attention_bias=True)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    ref.save_pretrained(path)
    ours = load_model(path, dtype="float32")
    tokens = _tokens(2, 16)
    with torch.no_grad():
        want = ref(tokens).logits  # [1, 16, V]
    logits, _ = ours(tokens, AttentionMetadata.prefill([16], "cpu"), ours.new_cache(1, 16))
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_decode_steps_on_the_attention_kernel_give_the_prefills_logits(arch_dir: Path) -> None:
    """In fp32 a prefill attends with torch's ops; here every DECODE step attends with the
    native per-query kernel instead (as the row-exact formats' steps do; forced, since fp32
    projections are not row-exact): 32 steps past a 16-token window give the prefill's logits,
    which a part the kernel's call left out (Gemma 2's soft-cap, a window) would not. (The
    native whole-block call gives this route's bits: test_native_blocks_give_the_python_...)"""
    model = load_model(arch_dir, dtype="float32")
    for block in model.layers:
        block.self_attn.per_query = True
    tokens = _tokens(8, 40)
    want, _ = model(tokens, AttentionMetadata.prefill([40], "cpu"), model.new_cache(1, 40))
    _assert_steps_give(model, tokens, want, prefill=8)


def test_longrope_keeps_each_cached_tokens_rotation_past_the_original_context(
    tmp_path: Path,
) -> None:
    """Phi-3 one token at a time from position 48 to 96, across its original context of 64:
    each step's fp32 logits equal transformers' forward over its cache, which rotates a new
    token with the short factors while the sequence fits the original context and with the
    long ones after, and keeps what it cached (a prefill past 64 would rotate all with the
    long ones: there the two differ, by design)."""
    folder = build(tmp_path / "phi3", "phi3")
    ours = load_model(folder, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = _tokens(7, 96)
    cache = ours.new_cache(1, 96)
    ours(tokens[:, :48], AttentionMetadata.prefill([48], "cpu"), cache)
    with torch.no_grad():
        past = ref(tokens[:, :48], use_cache=True).past_key_values
        for t in range(48, 96):
            out = ref(tokens[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [t], [1], "cpu")
            step, _ = ours(tokens[:, t : t + 1], meta, cache)
            torch.testing.assert_close(step[:, 0], out.logits[:, 0], atol=1e-4, rtol=1e-4)


def test_greedy_32_tokens_equal_transformers(arch_dir: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(arch_dir, dtype=torch.float32).eval()
    llm = LLM(str(arch_dir), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for seed in (2, 3, 4):
        prompt = _tokens(seed, 12)
        with torch.no_grad():
            out = ref.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
        (ours,) = llm.generate({"prompt_token_ids": prompt[0].tolist()}, params)
        assert list(ours.token_ids) == out[0, 12:].tolist()


@pytest.fixture(scope="module")
def arch_gguf_dir(arch_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """arch_dir's model as a model.gguf (Q8_0 / Q4_K / Q6_K blocks, fp32 norms); None for an
    architecture whose GGUF files we do not read (Phi-3)."""
    from gguf_cases import build_tiny_gguf

    if not arch_dir.name.startswith(GGUF_ARCHITECTURES):
        return None
    return build_tiny_gguf(arch_dir, tmp_path_factory.mktemp(f"gguf_{arch_dir.name}") / "model")


@pytest.mark.parametrize(
    ("dtype", "fmt"),
    [("bfloat16", None), ("float32", "int8"), ("bfloat16", "int8"), ("bfloat16", "gguf")],
)
def test_native_blocks_give_the_python_blocks_bits(
    arch_dir: Path, arch_gguf_dir: Path | None, dtype: str, fmt: str | None
) -> None:
    """Qwen3's q/k head norms, Gemma's block (its 1 + w norms applied in fp32 before
    rounding, the norms of each sublayer's output, GeGLU, the query scale) and sliding
    windows run inside the native decoder layer: DECODE and TREE passes, up to 17 tokens past
    the tiny Gemma's window of 16, give the Python blocks' logits and cache bit for bit."""
    from native_blocks import assert_native_blocks_give_python_bits

    if fmt == "gguf" and arch_gguf_dir is None:
        pytest.skip("no GGUF reader for this architecture")
    model = load_model(arch_gguf_dir if fmt == "gguf" else arch_dir, dtype, quantization=fmt)
    assert_native_blocks_give_python_bits(model, VOCAB, prompt=24)


@pytest.mark.parametrize("fmt", ["float32", "int8", "gguf"])
def test_speculation_gives_plain_output(
    arch_dir: Path, arch_gguf_dir: Path | None, tmp_path_factory: pytest.TempPathFactory, fmt: str
) -> None:
    """ngram (chain and tree), in fp32 and int8 a draft model of the same architecture, in
    fp32 suffix and lookahead decoding, alone and in a batch of three; in int8 and gguf
    (quantized q|k|v, norms read from model.gguf) bit for bit: every projection is row-exact
    and each block one native call in DECODE and TREE passes."""
    name = next(n for n in ARCHITECTURES if arch_dir.name.startswith(n))
    folder, weights = arch_dir, {"dtype": "float32"}
    if fmt != "float32":
        weights = {"dtype": "bfloat16", "quantization": fmt}
    if fmt == "gguf":
        if arch_gguf_dir is None:
            pytest.skip("no GGUF reader for this architecture")
        folder = arch_gguf_dir
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 5, 6, 7, 5, 6] * 2, [9, 1] * 3)]
    prompts.append({"prompt_token_ids": _tokens(5, 20)[0].tolist()})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    plain = LLM(str(folder), **weights)
    want = plain.generate(prompts, params)
    configs: list[dict[str, Any]] = [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "tree_width": 2},
    ]
    if fmt == "float32":  # the token-level drafters: the formats are the ngram runs' to check
        configs += [
            {"method": "suffix", "num_speculative_tokens": 6},
            {"method": "lookahead", "window_size": 4, "ngram_size": 3, "guess_set_size": 4},
        ]
    if fmt != "gguf":
        draft = build(tmp_path_factory.mktemp(f"draft_{name}"), name, seed=1)
        configs.append({"model": str(draft), "num_speculative_tokens": 3})
    for config in configs:
        spec = plain.with_speculative_config(config)
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], config
        if fmt != "float32":
            assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
        (alone,) = spec.generate(prompts[2], params)
        assert alone.token_ids == want[2].token_ids


def test_a_padded_prefill_gives_each_row_its_pass_alone(arch_dir: Path) -> None:
    """PREFILL on row-exact layers (bf16): a prompt, or a chunk after its cached prefix, run as
    a right-padded row of a multi-row pass gets bit for bit its pass alone, whatever the
    padded width: rows of 22 and 5 new tokens, 10 after 6 cached, and 1 after 30 (past a
    window of 16, where the row's window mask must still apply). torch's SDPA over the padded
    width moves its rounding (these rows differed with ATen's AVX-512 and AVX2 kernels)."""
    model = load_model(arch_dir, dtype="bfloat16")
    assert model.layers[0].self_attn.per_query  # bf16 projections are row-exact
    starts, new = [0, 0, 6, 30], [22, 5, 10, 1]
    ids = _tokens(12, 4 * 52).view(4, 52)
    cache = model.new_cache(4, 64)
    prefix = AttentionMetadata.contiguous(AttentionMode.PREFILL, [0] * 4, starts, "cpu")
    model(ids[:, :30], prefix, cache)  # the cached prefixes (rows with none are idle)
    chunk = torch.stack([ids[r, s : s + 22] for r, s in enumerate(starts)])  # [4, 22]
    meta = AttentionMetadata.contiguous(AttentionMode.PREFILL, starts, new, "cpu")
    together, hidden = model(chunk, meta, cache, hidden_layers=(1, 2))
    for r, (start, n) in enumerate(zip(starts, new, strict=True)):
        alone = model.new_cache(1, 64)
        if start:
            model(ids[r : r + 1, :start], AttentionMetadata.prefill([start], "cpu"), alone)
        meta = AttentionMetadata.contiguous(AttentionMode.PREFILL, [start], [n], "cpu")
        logits, states = model(ids[r : r + 1, start : start + n], meta, alone, hidden_layers=(1, 2))
        assert torch.equal(together[r, :n], logits[0]), r
        assert torch.equal(hidden[r, :n], states[0]), r


def test_a_padded_prefill_is_row_exact_on_torchs_avx2_path() -> None:
    """torch picks its CPU kernels by the CPU (AVX-512 on Xeons and Zen 4, AVX2 on Zen 3);
    ATEN_CPU_CAPABILITY forces another at its import, so a machine with AVX-512 also checks
    the path the AVX2 machines take (on those, the test above already runs it)."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        pytest.skip("torch already runs its AVX2 (or scalar) kernels here: the test above")
    test = f"{Path(__file__)}::test_a_padded_prefill_gives_each_row_its_pass_alone"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:]


def test_llama3_scaling_keeps_slows_and_blends_the_three_bands() -> None:
    """Short wavelengths kept, long ones divided by the factor, the band between blended."""
    scaling = RopeScaling(8.0, 1.0, 4.0, 64)
    inv_freq = torch.tensor([1.0, 0.2, 0.05, 0.001], dtype=torch.float64)
    # wavelengths 6.3 (< 64 / 4: kept), 31.4 (between 16 and 64), 126 and 6283 (> 64: / 8)
    got = scaling.frequencies(inv_freq)
    blend = (64 / (2 * torch.pi / 0.2) - 1.0) / 3.0
    want = [1.0, 0.2 * (blend + (1 - blend) / 8), 0.05 / 8, 0.001 / 8]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    plain, scaled = Rotary(16, 500000.0, 8), Rotary(16, 500000.0, 8, scaling)
    assert torch.equal(plain.sin[:, 0], scaled.sin[:, 0])  # the fastest frequency: kept
    torch.testing.assert_close(scaled.sin[1:, 7], plain.sin[1:, 7] / 8)  # the slowest: / 8


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {
                "model_type": "llama",
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0},
            },
            "mscale",
        ),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "yarn'"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}, "needs a factor > 0"),
        (
            {"model_type": "llama", "rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 0.5}},
            "high_freq_factor > low_freq_factor",
        ),
        (
            {"model_type": "gemma"},
            "supported: llama, mistral, qwen2, mimo, qwen3, gemma2, gemma3_text, phi3",
        ),
        ({"model_type": "gemma2", "attn_logit_softcapping": 0.0}, "attn_softcap must be > 0"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
        (
            {
                "model_type": "phi3",
                "original_max_position_embeddings": 64,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            },
            "needs 8 short and long factors",
        ),
        (
            {
                "model_type": "phi3",
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": []},
            },
            "needs original_max_position_embeddings",
        ),
        ({"model_type": "llama", "hidden_act": "gelu"}, "supported: silu, gelu_pytorch_tanh"),
        (
            {"model_type": "gemma3_text", "sliding_window": 8, "layer_types": ["local"] * 3},
            "layer_types must name 3 layers",
        ),
        (
            {
                "model_type": "gemma3_text",
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 8.0},
                },
            },
            "of the sliding layers",
        ),
    ],
)
def test_configs_we_cannot_run_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        ModelConfig.from_hf_dict({**SIZES, **fields})


@pytest.mark.parametrize(
    ("fields", "window", "sliding"),
    [
        ({"model_type": "mistral", "sliding_window": CONTEXT}, None, ()),  # covers the context
        ({"model_type": "mistral", "sliding_window": 64}, 64, (0, 1, 2)),
        ({"model_type": "qwen3", "sliding_window": 32}, None, ()),  # use_sliding_window off
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 32,
                "max_window_layers": 1,
            },
            32,
            (1, 2),
        ),
        (
            {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 2},
            8,
            (0, 2),
        ),
        # Gemma's sliding layers keep their local RoPE base when the window covers the context
        (
            {"model_type": "gemma3_text", "sliding_window": 4096, "sliding_window_pattern": 2},
            4096,
            (0, 2),
        ),
        ({"model_type": "gemma2", "sliding_window": 8}, 8, (0, 2)),  # every second layer
        # transformers' default max_window_layers (28) leaves none of 3 layers sliding
        ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 32}, None, ()),
        ({"model_type": "llama", "sliding_window": 8}, None, ()),  # Llama has none
    ],
)
def test_the_config_says_which_layers_slide(
    fields: dict[str, Any], window: int | None, sliding: tuple[int, ...]
) -> None:
    cfg = ModelConfig.from_hf_dict({**SIZES, **fields})
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, sliding)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def _llama_cpp_divisors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """rope_freqs as llama.cpp's converter writes them for Llama 3.x: each frequency's
    divisor, 1 / ((1 - smooth) / factor + smooth), in fp32."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        context = scaling.original_max_position_embeddings
        if wavelength < context / scaling.high_freq_factor:
            divisors.append(1.0)
        elif wavelength > context / scaling.low_freq_factor:
            divisors.append(scaling.factor)
        else:
            low, high = scaling.low_freq_factor, scaling.high_freq_factor
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _write_gguf_config(
    path: Path,
    head_dim: int,
    theta: float,
    rope_freqs: np.ndarray | None,
    arch: str = "llama",
    extra: Callable[[Any], None] | None = None,
    layers: int = 2,
) -> Path:
    """A GGUF holding a model's metadata (`layers` blocks) and a rope_freqs tensor (no
    weights); `extra` writes more into the writer."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch=arch)
    if extra is not None:
        extra(writer)
    writer.add_vocab_size(VOCAB)
    writer.add_embedding_length(4 * head_dim)
    writer.add_feed_forward_length(8 * head_dim)
    writer.add_block_count(layers)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(theta)
    writer.add_context_length(CONTEXT)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192)),  # Llama 3.2 1B / 3B
        (128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)),  # Llama 3.1 8B
        (16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64)),  # the tiny llama3 above: one blended
        (16, 10000.0, RopeScaling(4.0, 1.0, 4.0, 2)),  # nothing blended
    ],
)
def test_a_ggufs_rope_freqs_read_back_as_llama3_scaling(
    tmp_path: Path, head_dim: int, theta: float, scaling: RopeScaling
) -> None:
    """llama.cpp keeps only each frequency's divisor: the config reads them back as the
    llama3 scaling that gives the same frequencies (the parameters themselves where the
    divisors pin them down), and the conversion skips the tensor."""
    from specdecode.model.convert import config_from_gguf, iter_hf_tensors, open_gguf

    divisors = _llama_cpp_divisors(head_dim, theta, scaling)
    reader = open_gguf(_write_gguf_config(tmp_path / "m.gguf", head_dim, theta, divisors))
    cfg = config_from_gguf(reader)
    assert cfg.rope_scaling is not None
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(
        cfg.rope_scaling.frequencies(inv_freq), scaling.frequencies(inv_freq), rtol=1e-6, atol=0
    )
    if head_dim >= 64:
        assert cfg.rope_scaling == scaling
    assert list(iter_hf_tensors(reader, cfg)) == []


@pytest.mark.parametrize(
    ("divisors", "message"),
    [
        (np.linspace(1.0, 8.0, 8, dtype=np.float32), "not Llama 3.x's scaling"),
        (np.ones(5, dtype=np.float32), "must hold 8 divisors"),
        (np.full(8, 0.5, dtype=np.float32), "divisors >= 1"),
    ],
)
def test_rope_freqs_of_another_form_are_refused(
    tmp_path: Path, divisors: np.ndarray, message: str
) -> None:
    from specdecode.model.convert import config_from_gguf, open_gguf

    reader = open_gguf(_write_gguf_config(tmp_path / "m.gguf", 16, 500000.0, divisors))
    with pytest.raises(UserError, match=message):
        config_from_gguf(reader)


def test_unit_rope_freqs_are_no_scaling(tmp_path: Path) -> None:
    from specdecode.model.convert import config_from_gguf, open_gguf

    ones = np.ones(8, dtype=np.float32)
    reader = open_gguf(_write_gguf_config(tmp_path / "m.gguf", 16, 500000.0, ones))
    assert config_from_gguf(reader).rope_scaling is None


@pytest.mark.parametrize(
    ("kind", "factor", "scaling"),
    [("linear", 8.0, LinearRope(8.0)), ("linear", 1.0, None), ("none", None, None)],
)
def test_a_ggufs_linear_rope_scaling_is_read(
    tmp_path: Path, kind: str, factor: float | None, scaling: LinearRope | None
) -> None:
    """llama.cpp writes linear scaling (Gemma 3 4B and larger) as rope.scaling.type and
    rope.scaling.factor."""
    from gguf import RopeScalingType

    from specdecode.model.convert import config_from_gguf, open_gguf

    def linear(writer: Any) -> None:
        writer.add_rope_scaling_type(RopeScalingType(kind))
        if factor is not None:
            writer.add_rope_scaling_factor(factor)

    reader = open_gguf(_write_gguf_config(tmp_path / "m.gguf", 16, 1e4, None, extra=linear))
    cfg = config_from_gguf(reader)
    assert cfg.rope_scaling == scaling
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_a_ggufs_yarn_scaling_is_read(tmp_path: Path) -> None:
    """llama.cpp writes YaRN (Qwen past its native context) as rope.scaling.type "yarn", the
    factor, the original context and its own beta keys; DeepSeek's variant (a log multiplier)
    and a file without the original context are refused."""
    from gguf import RopeScalingType

    from specdecode.model.convert import config_from_gguf, open_gguf

    def yarn(*extra: tuple[str, float]) -> Callable[[Any], None]:
        def write(writer: Any) -> None:
            writer.add_rope_scaling_type(RopeScalingType.YARN)
            writer.add_rope_scaling_factor(4.0)
            for key, value in extra:
                writer.add_float32(f"llama.rope.scaling.{key}", value)

        return write

    cases = [(), (("original_context_length", 64.0), ("yarn_beta_fast", 16.0))]
    cases.append((("original_context_length", 64.0), ("yarn_log_multiplier", 0.1)))
    paths = [
        _write_gguf_config(tmp_path / f"m{i}.gguf", 16, 1e4, None, extra=yarn(*case))
        for i, case in enumerate(cases)
    ]
    with pytest.raises(UserError, match=r"needs a factor >= 1 and llama\.rope\.scaling\.original"):
        config_from_gguf(open_gguf(paths[0]))
    cfg = config_from_gguf(open_gguf(paths[1]))
    assert cfg.rope_scaling == Yarn(4.0, 64, 16.0, 1.0, 0.1 * math.log(4.0) + 1.0)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(UserError, match="yarn_log_multiplier"):
        config_from_gguf(open_gguf(paths[2]))


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5 / Qwen3's advice
        {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0},
        {"factor": 2.0, "original_max_position_embeddings": 2048, "truncate": False},
        {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
    ],
)
def test_yarn_gives_transformers_frequencies_and_attention_factor(rope: dict[str, Any]) -> None:
    """Yarn's scaled frequencies and attention factor are transformers' own (its
    `_compute_yarn_parameters`), head_dim 128 and RoPE base 1e6 (Qwen3's)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {"rope_type": "yarn", "rope_theta": 1e6, **rope}
    config = Qwen3Config(head_dim=128, max_position_embeddings=131072, rope_parameters=fields)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = ModelConfig.from_hf_dict({**SIZES, "model_type": "qwen3", "rope_scaling": fields})
    scaling = ours.rope_scaling
    assert isinstance(scaling, Yarn) and scaling.attention_factor == pytest.approx(factor)
    got = scaling.frequencies(base_frequencies(1e6, 128))
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0.0)  # theirs in fp32


def test_a_yarn_model_gives_transformers_logits(tmp_path: Path) -> None:
    """A tiny Qwen2 with YaRN (factor 4 over an original context of 64; its attention factor
    scales cos and sin): fp32 logits over 64 tokens equal transformers'."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    folder = build_tiny_model(tmp_path / "yarn", "qwen2", 0, CONTEXT, rope_scaling=yarn)
    ours = load_model(folder, dtype="float32")
    assert isinstance(ours.config.rope_scaling, Yarn)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = _tokens(9, 64)
    with torch.no_grad():
        want = ref(tokens).logits  # [1, 64, V]
    got, _ = ours(tokens, AttentionMetadata.prefill([64], "cpu"), ours.new_cache(1, 64))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_phi3_ggufs_longrope_and_window_are_read(tmp_path: Path) -> None:
    """Phi-3's GGUF keeps LongRoPE's factors as tensors and the original context (and any
    attention factor) as metadata; its window applies to every layer."""
    from specdecode.model.convert import config_from_gguf, iter_hf_tensors, open_gguf

    short = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    long = np.linspace(1.0, 9.0, 8, dtype=np.float32)

    def phi3(writer: Any) -> None:
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_sliding_window(48)
        writer.add_tensor("rope_factors_short.weight", short)
        writer.add_tensor("rope_factors_long.weight", long)

    reader = open_gguf(_write_gguf_config(tmp_path / "m.gguf", 16, 1e4, None, "phi3", phi3))
    cfg = config_from_gguf(reader)
    scaling = cfg.rope_scaling
    assert cfg.architecture == "phi3" and isinstance(scaling, LongRope)
    assert (scaling.short_factor, scaling.long_factor) == (tuple(short), tuple(long))
    assert scaling.original_max_position_embeddings == 64
    assert scaling.attention_factor == pytest.approx((1 + 1 / 3) ** 0.5)  # ln 4 / ln 64
    assert (cfg.sliding_window, cfg.sliding_layers) == (48, (0, 1))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # the converted folder's config
    assert list(iter_hf_tensors(reader, cfg)) == []

    def half(writer: Any) -> None:
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_tensor("rope_factors_short.weight", short)

    reader = open_gguf(_write_gguf_config(tmp_path / "h.gguf", 16, 1e4, None, "phi3", half))
    with pytest.raises(UserError, match="needs both rope_factors_short"):
        config_from_gguf(reader)


@pytest.mark.parametrize(
    ("arch", "layers", "sliding", "scale"),
    [
        ("gemma2", 3, (0, 2), None),  # every second layer slides
        ("gemma2", 46, tuple(range(0, 46, 2)), 16**-0.5),  # 27B: (hidden / heads) ** -0.5
        ("gemma3", 7, (0, 1, 2, 3, 4, 6), None),  # every sixth attends globally
        ("gemma3", 62, tuple(i for i in range(62) if i % 6 != 5), 16**-0.5),  # 27B
    ],
)
def test_a_gemma_ggufs_windows_caps_and_query_scale_are_read(
    tmp_path: Path, arch: str, layers: int, sliding: tuple[int, ...], scale: float | None
) -> None:
    """What llama.cpp fixes rather than writes: which layers slide, Gemma 3's local RoPE base
    and the 27B models' query scale (hidden 64 / 4 heads = 16 per head, against head_dim 32);
    the window and the soft-caps come from the file."""
    from specdecode.model.convert import config_from_gguf, open_gguf

    def gemma(writer: Any) -> None:
        writer.add_key_length(32)
        writer.add_value_length(32)
        writer.add_sliding_window(8)
        writer.add_final_logit_softcapping(30.0)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(50.0)

    path = _write_gguf_config(tmp_path / "m.gguf", 16, 1e4, None, arch, gemma, layers)
    cfg = config_from_gguf(open_gguf(path))
    assert cfg.architecture == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    assert cfg.gemma and cfg.head_dim == 32 and cfg.sliding_window == 8
    assert cfg.sliding_layers == sliding and cfg.attention_scale == scale
    assert cfg.logit_softcap == 30.0
    assert cfg.attn_softcap == (50.0 if arch == "gemma2" else None)
    assert cfg.local_rope_theta == (None if arch == "gemma2" else 10000.0)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # the converted folder's config


def test_fused_weights_of_the_wrong_size_are_refused() -> None:
    from specdecode.model.loading import split_fused

    cfg = ModelConfig.from_hf_dict({**SIZES, "model_type": "phi3"})
    qkv = torch.zeros(64 + 2 * 32 - 1, 64)  # q 4 x 16 rows, k and v 2 x 16 each, one short
    with pytest.raises(UserError, match=r"qkv_proj\.weight has 127 rows; the config needs 128"):
        split_fused({"model.layers.0.self_attn.qkv_proj.weight": qkv}, cfg)
    gate_up = torch.arange(256.0)[:, None].expand(256, 64)
    split = split_fused({"model.layers.1.mlp.gate_up_proj.weight": gate_up}, cfg)
    assert split["model.layers.1.mlp.gate_proj.weight"][0, 0] == 0  # gate first
    assert split["model.layers.1.mlp.up_proj.weight"][0, 0] == 128
