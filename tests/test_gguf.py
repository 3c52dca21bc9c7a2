"""quantization="gguf": GGUF blocks decoded without rounding, the kernel against a reference,
row-exactness, and whole models (tiny GGUF models built here) that speculate exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import runnable_variants, select_variant
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from gguf_cases import build_tiny_gguf, random_blocks
from spec_cases import GREEDY, PROMPTS

from specdecode import kernels
from specdecode.bench.parity import exact_model
from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.drafters.medusa import MedusaConfig
from specdecode.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.gguf_blocks import LAYOUTS, decode, pack, unpack
from specdecode.model.gguf_linear import GgufLinear, GgufSegment, GgufWeight, requantize
from specdecode.model.gguf_tensors import read_tensors
from specdecode.model.loading import load_model
from specdecode.model.transformer import Transformer

T = GGMLQuantizationType
TYPES = list(LAYOUTS)


def _linear(types: list[GGMLQuantizationType], rows: list[int], cols: int, bias: bool = False):
    segments = tuple(
        GgufSegment(t, random_blocks(t, n, cols, seed=i))
        for i, (t, n) in enumerate(zip(types, rows, strict=True))
    )
    b = torch.randn(sum(rows), generator=torch.Generator().manual_seed(3)) if bias else None
    return GgufLinear.from_blocks(GgufWeight(segments, cols), b)


def _quantized(x: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] quantized as llama.cpp's CPU backend does for a dot product: int8 codes
    [M, K], scales dx [M, K / block] (fp16-rounded for block 32: Q8_0), sx [M, K / 32]
    (Q8_1's fp16(d * sum))."""
    blocks = x.float().numpy().reshape(x.shape[0], -1, block)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.divide(127, absmax, out=np.zeros_like(absmax), where=absmax > 0).astype(np.float32)
    codes = np.rint(blocks * inv)  # round half to even, as _mm256_round_ps and nearest_int
    d = (absmax / np.float32(127)).astype(np.float32)[..., 0]
    sx = (d * codes.sum(-1)).astype(np.float16).astype(np.float64)
    if block == 32:
        dx = d.astype(np.float16).astype(np.float64)
    else:
        dx = np.where(inv[..., 0] > 0, 1 / np.maximum(inv[..., 0], 1e-30), 0).astype(np.float64)
    return codes.reshape(x.shape).astype(np.float64), dx, sx


def _reference(x: torch.Tensor, module: GgufLinear) -> torch.Tensor:
    """y = x @ W^T + b in float64 from the codes and llama.cpp's activations (`_quantized`)."""
    out = []
    for codes in module.codes():
        lay = codes.layout
        x8, dx, sx = _quantized(x, lay.superblock)
        xs = (x8.reshape(*dx.shape, -1) * dx[..., None]).reshape(x8.shape)  # [M, K]
        rows = codes.q.shape[0]
        sc = 1.0 if codes.sc is None else codes.sc.astype(np.float64).reshape(rows, -1, 1)
        q = codes.q.astype(np.float64).reshape(rows, -1, lay.sub) - lay.off
        d = np.repeat(codes.D.astype(np.float64), lay.subs, axis=1)[..., None]
        y = xs @ (d * sc * q).reshape(rows, -1).T
        if lay.mins == 1:
            m = np.repeat(codes.M.astype(np.float64), lay.subs, axis=1) * codes.mn
            y -= xs @ np.repeat(m, lay.sub, axis=1).T
        elif lay.mins == 2:
            y -= sx @ codes.M.astype(np.float64).T
        out.append(y)
    y = torch.from_numpy(np.concatenate(out, axis=1))
    return y if module.bias is None else y + module.bias.double()


@pytest.mark.parametrize("tensor_type", TYPES, ids=[t.name for t in TYPES])
def test_blocks_decode_to_what_gguf_dequantizes_and_pack_round_trips(tensor_type) -> None:
    raw = random_blocks(tensor_type, 40, 512)
    codes = decode(tensor_type, raw, 512)
    assert np.array_equal(codes.weights(), dequantize(raw, tensor_type).reshape(40, 512))
    back = unpack(pack(codes), codes.layout, 40)
    for field in ("q", "D", "M", "sc", "mn"):
        want, got = getattr(codes, field), getattr(back, field)
        assert (want is None and got is None) or np.array_equal(want, got), field


@pytest.mark.parametrize("block", [32, 256])
def test_activations_are_quantized_as_llama_cpp_quantizes_them(
    block: int, kernel_path: str
) -> None:
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(5))
    x[2] *= 300
    x[4, :256] = 0  # an all-zero block: zero codes and scale
    acts = kernels.gguf_quantize(x, block)
    x8, dx, sx = _quantized(x, block)
    assert np.array_equal(acts.x8.numpy(), x8) and np.array_equal(acts.dx.numpy(), dx)
    assert acts.sx.numpy().size == 0 if block == 256 else np.array_equal(acts.sx.numpy(), sx)
    assert np.array_equal(acts.bsum16.numpy(), x8.reshape(7, -1, 16).sum(-1))
    assert np.array_equal(acts.bsum32.numpy(), x8.reshape(7, -1, 32).sum(-1))
    with pytest.raises(RuntimeError, match="blocks are 32 or 256"):
        kernels.gguf_quantize(x, 64)


@pytest.mark.parametrize("tensor_type", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference_and_each_token_is_row_exact(
    tensor_type, dtype, kernel_path: str
) -> None:
    module = _linear([tensor_type], [72], 512, bias=True)  # 72 rows: a partial tile of 16
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(1))  # 8 + 8 + 3 tokens
    x[5] *= 40  # an outlier token: a per-pass scale would move every other token
    y = module(x.to(dtype))
    assert y.shape == (19, 72) and y.dtype == dtype
    want = _reference(x.to(dtype).float(), module)
    error = float((y.double() - want).abs().max() / want.abs().max())
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
    alone = torch.cat([module(x[i : i + 1].to(dtype)) for i in range(19)])
    assert torch.equal(y, alone)
    assert torch.equal(module(x[3:7].to(dtype)), y[3:7])


def test_every_kernel_build_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer sums: AMX / AVX-512, AVX2 and portable C++ agree bit for bit, per block type."""
    builds = runnable_variants()
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(7))
    outputs: dict[str, list[torch.Tensor]] = {}
    for name in builds:
        select_variant(name, monkeypatch)
        outputs[name] = [_linear([t], [40], 512, bias=True)(x) for t in TYPES]
    for name in builds:
        for tensor_type, got, want in zip(TYPES, outputs[name], outputs[builds[0]], strict=True):
            assert torch.equal(got, want), (name, builds[0], tensor_type.name)
    select_variant("auto", monkeypatch)


def test_a_fused_weight_mixes_types_in_segments() -> None:
    """q|k|v of Q4_K_M: Q4_K rows then Q6_K rows, one activation quantization for both; a mix of
    Q8_0 and Q4_K rows quantizes the activations both ways."""
    module = _linear([T.Q4_K, T.Q6_K, T.Q4_K], [48, 20, 16], 256, bias=True)
    assert [layout.superblock for layout, _, _ in module.layouts] == [256] * 3
    x = torch.randn(3, 2, 256, generator=torch.Generator().manual_seed(2))
    y = module(x)
    assert y.shape == (3, 2, 84)
    want = _reference(x.reshape(6, 256), module).reshape(3, 2, 84)
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5
    mixed = _linear([T.Q8_0, T.Q4_K], [16, 32], 512)
    assert [layout.superblock for layout, _, _ in mixed.layouts] == [32, 256]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    want = _reference(x, mixed)
    assert float((mixed(x).double() - want).abs().max() / want.abs().max()) < 1e-5
    merged = GgufWeight.cat(
        [GgufWeight((GgufSegment(T.Q8_0, random_blocks(T.Q8_0, 4, 64)),), 64)] * 2
    )
    assert len(merged.segments) == 1 and merged.out_features == 8


def test_rows_keeps_the_blocks_of_the_kept_rows_across_segments() -> None:
    """`rows(kept)` (a trimmed head) gives the full projection's kept outputs bit for bit, rows
    picked from several segments and a segment with none kept left out."""
    module = _linear([T.Q8_0, T.Q4_0, T.Q6_K], [16, 32, 20], 256, bias=True)
    kept = torch.tensor([0, 5, 15, 40, 66])  # none of the Q4_0 rows 16..47 but 40
    cut = module.rows(kept)
    assert cut.out_features == 5 and len(cut.layouts) == 3
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(cut(x), module(x)[:, kept])
    only_q8 = module.rows(torch.tensor([1, 2]))
    assert len(only_q8.layouts) == 1 and torch.equal(only_q8(x), module(x)[:, [1, 2]])


@pytest.mark.parametrize("tensor_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_requantized_blocks_are_llama_cpps(tensor_type) -> None:
    """A dense weight requantized at load is the gguf package's reference quantization of it
    (llama.cpp's rounding), in chunks of rows as in one call, and multiplies as that."""
    weight = torch.randn(70, 96, generator=torch.Generator().manual_seed(6))
    blocks = requantize(weight, tensor_type)
    (segment,) = blocks.segments
    want = quantize(weight.numpy(), tensor_type)
    assert segment.tensor_type == tensor_type and np.array_equal(segment.raw, want)
    module = GgufLinear.from_blocks(blocks)
    assert np.array_equal(module.dequantized().numpy(), dequantize(want, tensor_type))
    with pytest.raises(ValueError, match="in_features % 32 == 0, got 40"):
        requantize(torch.zeros(4, 40), tensor_type)


def test_unsupported_block_types_are_refused_clearly() -> None:
    with pytest.raises(
        ValueError, match="GGUF tensor type Q2_K has no kernel here; supported: Q4_0"
    ):
        decode(T.Q2_K, np.zeros((4, 84), np.uint8), 256)
    with pytest.raises(ValueError, match="in_features % 32 == 0"):
        GgufLinear.from_blocks(GgufWeight((GgufSegment(T.F32, np.zeros((4, 64), np.uint8)),), 16))


# --- whole models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "model")


def test_gguf_model_stays_close_to_the_dense_one(gguf_dir: Path) -> None:
    """The blocks are the dense weights quantized to 4-8 bits, q and k rows in llama.cpp's
    order: a wrong row order or scale would break the agreement."""
    dense = load_model(gguf_dir, "float32")
    model = load_model(gguf_dir, "float32", quantization="gguf")
    assert isinstance(model.lm_head, GgufLinear) and model.quantization == "gguf"
    tokens = torch.tensor([PROMPTS[1]["prompt_token_ids"]])
    meta = AttentionMetadata.prefill([tokens.shape[1]], "cpu")
    want, _ = dense(tokens, meta, dense.new_cache(1, 64))
    got, _ = model(tokens, meta, model.new_cache(1, 64))
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pass_over_k_tokens_equals_k_decode_steps_bit_for_bit(gguf_dir: Path, dtype) -> None:
    model = load_model(gguf_dir, dtype, quantization="gguf")
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 17, 42, 99, 7, 8, 9]] * 2)  # [2, 12]
    cache = model.new_cache(2, 32)
    model(ids[:, :6], AttentionMetadata.prefill([6, 6], "cpu"), cache)
    cache.truncate([6, 4])

    def decode_at(tokens: torch.Tensor) -> torch.Tensor:  # [2, T] at each row's length
        meta = AttentionMetadata.contiguous(
            AttentionMode.DECODE, cache.lengths, [tokens.shape[1]] * 2, "cpu"
        )
        return model(tokens, meta, cache)[0]

    together = decode_at(ids[:, 6:11])  # [2, 5, V]
    cache.truncate([6, 4])
    steps = [decode_at(ids[:, 6 + i : 7 + i]) for i in range(5)]
    assert torch.equal(together, torch.cat(steps, 1))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_equals_plain_in_gguf(gguf_dir: Path, method: str) -> None:
    plain = LLM(str(gguf_dir), dtype="bfloat16", quantization="gguf")
    config = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(gguf_dir), "num_speculative_tokens": 3, "draft_length": "fixed"}
    )
    spec = plain.with_speculative_config(config)
    if method == "draft_model":
        assert spec.draft_model is not None and spec.draft_model.quantization == "gguf"
    for prompt in PROMPTS:
        want = list(plain.generate(prompt, GREEDY)[0].token_ids)
        assert list(spec.generate(prompt, GREEDY)[0].token_ids) == want
    assert spec.spec_metrics.num_accepted_tokens > 0


def test_gguf_needs_a_gguf_file(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"has no model\.gguf: give a pulled alias or a \.gguf"):
        LLM(str(tiny_model_dir), quantization="gguf")
    with pytest.raises(ValueError, match="'gguf' has CPU kernels only, not meta"):
        load_model(tiny_model_dir, quantization="gguf", device="meta")
    with pytest.raises(ValueError, match=r"bfloat16 or float32, not torch\.float16"):
        load_model(tiny_model_dir, "float16", quantization="gguf")


def test_auto_runs_the_gguf_blocks_where_they_run(
    gguf_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The default format: the GGUF's own blocks for a model with a GGUF file on the CPU in
    bf16 / fp32; the dense weights otherwise (no GGUF, fp16, a block type without a kernel),
    and a draft model resolves it for itself."""
    assert LLM(str(gguf_dir)).model.quantization == "gguf"
    assert load_model(gguf_dir, "float16", quantization="auto").quantization is None
    plain = LLM(str(tiny_model_dir))
    assert plain.model.quantization is None and plain.weight_format == "bfloat16"
    spec = plain.with_speculative_config(
        {"model": str(gguf_dir), "num_speculative_tokens": 2, "draft_length": "fixed"}
    )
    assert spec.draft_model is not None and spec.draft_model.quantization == "gguf"
    odd = shutil.copytree(tiny_model_dir, tmp_path / "odd")
    writer = GGUFWriter(odd / "model.gguf", arch="llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 84), np.uint8), raw_dtype=T.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_model(odd, quantization="auto").quantization is None
    with pytest.raises(ValueError, match="Q2_K has no kernel here"):
        load_model(odd, quantization="gguf")


def test_auto_is_a_load_time_choice(tiny_model_dir: Path) -> None:
    """A head drafter's "auto" takes the target's format (its dense weights have no GGUF of
    their own); a Transformer built by hand needs a resolved format."""
    config = MedusaConfig(model="heads", num_speculative_tokens=2, quantization="auto")
    assert config.weight_format("gguf") == "gguf" and config.weight_format(None) is None
    assert (
        MedusaConfig(model="h", num_speculative_tokens=2, quantization="none").weight_format("gguf")
        is None
    )
    cfg = ModelConfig.from_folder(tiny_model_dir)
    with pytest.raises(ValueError, match="'auto' is resolved by load_model"):
        Transformer(cfg, {}, "auto")


def test_the_tensor_table_is_read_as_gguf_reads_it(gguf_dir: Path, tmp_path: Path) -> None:
    """`read_tensors` (no metadata parsing) gives GGUFReader's tensors; bad files get a clear
    error."""
    path = gguf_dir / "model.gguf"
    ours, theirs = read_tensors(path).tensors, GGUFReader(path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_tensors(tmp_path / "not.gguf")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:4000])
    with pytest.raises(ValueError, match="truncated"):
        read_tensors(tmp_path / "cut.gguf")


def test_the_exact_model_is_the_files_weights_in_fp32(gguf_dir: Path) -> None:
    """`exact_model`, the parity yardstick: every projection is its blocks dequantized, and the
    gguf model (int8 activations) stays close to it."""
    cfg = ModelConfig.from_folder(gguf_dir)
    exact = exact_model(gguf_dir / "model.gguf", cfg)
    model = load_model(gguf_dir, "float32", quantization="gguf")
    assert exact.quantization is None
    assert torch.equal(exact.lm_head.weight, model.lm_head.dequantized())  # fp32 DenseLinear
    tokens = torch.tensor([PROMPTS[0]["prompt_token_ids"]])
    meta = AttentionMetadata.prefill([tokens.shape[1]], "cpu")
    want, _ = exact(tokens, meta, exact.new_cache(1, 64))
    got, _ = model(tokens, meta, model.new_cache(1, 64))
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


def test_a_projection_checks_its_segments_once_and_its_input_each_call(kernel_path: str) -> None:
    """The segments are checked when the projection is built (so a call runs the kernels on
    raw pointers); a call checks x's width."""
    module = _linear([T.Q8_0, T.Q4_K], [16, 32], 512)
    with pytest.raises(RuntimeError, match="x has 256 features, the projection takes 512"):
        module(torch.randn(2, 256))
    packed = module.packed0
    layout = module.layouts[0][0]
    with pytest.raises(RuntimeError, match="the segments have 512 and 256 inputs"):
        kernels.gguf_projection(
            [(packed, layout, 16, 0), (packed[:, :8], layout, 16, 16)], None, 32
        )
    with pytest.raises(RuntimeError, match="lie outside the projection's 20"):
        kernels.gguf_projection([(packed, layout, 16, 8)], None, 20)
    with pytest.raises(RuntimeError, match="does not fit its 16 packed rows"):
        kernels.gguf_projection([(packed, layout, 40, 0)], None, 40)
    with pytest.raises(RuntimeError, match="bias must be a contiguous fp32 \\[16\\] tensor"):
        kernels.gguf_projection([(packed, layout, 16, 0)], torch.zeros(8), 16)
