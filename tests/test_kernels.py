"""specdecode's native CPU kernels: the int8 kernel against an exact reference, the packed
layout, and clear errors for arguments the kernels cannot take."""

from __future__ import annotations

import pytest
import torch

from specdecode import kernels
from specdecode.model.attention import rotate
from specdecode.model.quant import Int8DynamicLinear
from specdecode.model.rope import Rotary


def _int8_case(out: int, inp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The kernel's arguments as `Int8DynamicLinear` packs them, and the int8 weight and
    per-row scale they stand for (unpadded), for the reference."""
    gen = torch.Generator().manual_seed(seed)
    module = Int8DynamicLinear(torch.randn(out, inp, generator=gen) * 0.05)
    return {
        "q": kernels.unpack(module.packed, out, inp),  # [out, in] int8
        "scale": module.scale[:out],  # [out]
        "packed": module.packed,
        "padded_scale": module.scale,
        "row_sum": module.row_sum,
        "bias": torch.randn(out, generator=gen),
    }


def _int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor):
    """The kernel's arithmetic in torch: int8 codes per row, exact integer sums (in float64,
    exact at these sizes), then fp32 scaling and bias, rounded once to x's dtype."""
    xf = x.float()
    absmax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-8)  # [M, 1]
    codes = (xf * (torch.full_like(absmax, 127.0) / absmax)).round().clamp(-127, 127)
    dots = (codes.double() @ q.double().T).float()  # [M, out]
    return (dots * (absmax / 127 * scale) + bias).to(x.dtype)


@pytest.mark.parametrize(
    ("out", "inp", "rows"),
    # 600 inputs: the 256-bit paths' chunks of 256 (the last partial); tiles of 1, 2, 3 tokens
    [
        (96, 256, 1),
        (97, 200, 9),
        (13, 77, 5),
        (130, 192, 16),
        (130, 192, 40),
        (70, 600, 1),
        (70, 600, 2),
        (70, 600, 6),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_equals_the_reference_bit_for_bit(
    out: int, inp: int, rows: int, dtype: torch.dtype, kernel_path: str
) -> None:
    """On every path (AMX takes 192 and 256 input features, in chunks of 16 tokens)."""
    case = _int8_case(out, inp)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0] *= 40  # rows of very different ranges: each must use its own scale
    got = kernels.int8_linear(
        x, case["packed"], case["padded_scale"], case["row_sum"], case["bias"], out
    )
    assert got.dtype == dtype and got.shape == (rows, out)
    assert torch.equal(got, _int8_reference(x, case["q"], case["scale"], case["bias"]))


@pytest.mark.parametrize("per_lane", [kernels.INT8_PACK, kernels.BF16_PACK])
def test_pack_pads_and_unpack_inverts(per_lane: int) -> None:
    weight = torch.arange(70 * 9, dtype=torch.float32).view(70, 9)
    packed = kernels.pack(weight, per_lane)
    assert packed.shape == (2, -(-9 // per_lane), kernels.ROWS, per_lane)
    assert packed.sum() == weight.sum()  # the padding is zeros
    assert torch.equal(kernels.unpack(packed, 70, 9), weight)
    # one 64-byte vector: `per_lane` consecutive columns of 16 consecutive rows
    assert torch.equal(packed[0, 0, :16], weight[:16, :per_lane])


def test_kernel_arguments_are_checked() -> None:
    case = _int8_case(8, 32)
    args = (case["packed"], case["padded_scale"], case["row_sum"], None)
    with pytest.raises(RuntimeError, match="x has 27 features, the packed weight 32"):
        kernels.int8_linear(torch.randn(1, 27), *args, 8)
    with pytest.raises(RuntimeError, match="out_features 65 does not fit"):
        kernels.int8_linear(torch.randn(1, 32), *args, 65)
    with pytest.raises(RuntimeError, match="weight must be packed"):
        kernels.int8_linear(torch.randn(1, 32), case["q"], *args[1:], 8)
    packed = kernels.pack(torch.randn(8, 32).bfloat16(), kernels.BF16_PACK)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        kernels.bf16_linear(torch.randn(1, 32), packed, None, 8)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous fp32 \[8\] tensor"):
        kernels.bf16_linear(torch.randn(1, 32).bfloat16(), packed, torch.zeros(8).bfloat16(), 8)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("dim", [40, 64, 128])
def test_decode_attention_matches_causal_attention_per_query(
    dtype: torch.dtype, tolerance: float, dim: int, kernel_path: str
) -> None:
    """Rows of different lengths, grouped heads; head sizes with a path of their own (64, 128)
    and one that is not a multiple of 16."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, new, slots = 6, 2, 4, 50
    q = torch.randn(2, heads, new, dim, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, slots, dim, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, slots, dim, generator=gen).to(dtype)
    starts = [30, 7]
    got = kernels.decode_attention(q, k, v, starts)
    assert got.shape == q.shape and got.dtype == dtype
    for b, start in enumerate(starts):
        span = start + new  # query t sees slots 0 .. start + t
        allowed = torch.arange(span)[None, :] <= start + torch.arange(new)[:, None]  # [T, S]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1].float(),
            k[b : b + 1, :, :span].float(),
            v[b : b + 1, :, :span].float(),
            attn_mask=allowed,
            enable_gqa=True,
        )
        torch.testing.assert_close(got[b : b + 1].float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [40, 64, 128])
def test_decode_attention_gives_each_query_what_a_one_token_call_gives(
    dtype: torch.dtype, dim: int, kernel_path: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 9, dim, generator=gen).to(dtype)
    k = torch.randn(1, 2, 300, dim, generator=gen).to(dtype)
    v = torch.randn(1, 2, 300, dim, generator=gen).to(dtype)
    together = kernels.decode_attention(q, k, v, [250])
    for t in range(9):
        alone = kernels.decode_attention(q[:, :, t : t + 1], k, v, [250 + t])
        assert torch.equal(together[:, :, t : t + 1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 2, 128), (7, 1, 40), (9, 3, 64)])
def test_decode_attention_gives_the_same_bits_on_any_number_of_threads(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, kernel_path: str
) -> None:
    """The query heads that share a KV head attend together in blocks whose size follows the
    thread pool's (AVX2, NEON): a head's output must not depend on its block."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, heads, 3, dim, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, 90, dim, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, 90, dim, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 8):
            torch.set_num_threads(threads)
            outputs.append(kernels.decode_attention(q, k, v, [60, 33]))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_decode_attention_reads_the_window_alone(
    dtype: torch.dtype, kernel_path: str
) -> None:
    """Sliding-window attention: a query at position p reads slots p - W + 1 .. p (the masked
    reference), and a pass gives each query what a one-token pass gives, for a row past its
    window and one still inside it."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, new, slots, dim, window = 4, 2, 5, 80, 64, 16
    q = torch.randn(2, heads, new, dim, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, slots, dim, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, slots, dim, generator=gen).to(dtype)
    starts = [70, 3]
    got = kernels.decode_attention(q, k, v, starts, window=window)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    for b, start in enumerate(starts):
        span = start + new
        position = start + torch.arange(new)[:, None]  # [T, 1]
        slot = torch.arange(span)[None, :]  # [1, S]
        allowed = (slot <= position) & (slot > position - window)  # [T, S]
        rows = slice(b, b + 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[rows].float(),
            k[rows, :, :span].float(),
            v[rows, :, :span].float(),
            attn_mask=allowed,
            enable_gqa=True,
        )
        torch.testing.assert_close(got[rows].float(), want, atol=tolerance, rtol=tolerance)
        for t in range(new):
            alone = kernels.decode_attention(
                q[rows, :, t : t + 1], k[rows], v[rows], [start + t], window=window
            )
            assert torch.equal(got[rows, :, t : t + 1], alone)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("dim", [40, 64, 128])
def test_soft_capped_decode_attention_caps_each_score(
    dtype: torch.dtype, tolerance: float, dim: int, kernel_path: str
) -> None:
    """Gemma 2's soft-cap: each score q.k / sqrt(D) becomes cap * tanh(score / cap) before the
    softmax (the reference below), on every head size's path; a pass gives each query what a
    one-token pass gives; a negative cap is refused."""
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, new, slots, cap = 4, 2, 3, 40, 1.5  # scores of ~N(0, 1): most bend
    q = torch.randn(1, heads, new, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
    start = slots - new
    got = kernels.decode_attention(q, k, v, [start], softcap=cap)
    keys = k.float().repeat_interleave(heads // kv_heads, dim=1)  # [1, H, S, D]
    scores = q.float() @ keys.transpose(-1, -2) * dim**-0.5  # [1, H, T, S]
    scores = torch.tanh(scores / cap) * cap
    visible = torch.arange(slots)[None, :] <= start + torch.arange(new)[:, None]  # [T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    want = scores.softmax(-1) @ v.float().repeat_interleave(heads // kv_heads, dim=1)
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
    uncapped = kernels.decode_attention(q, k, v, [start])
    assert (got.float() - uncapped.float()).abs().max() > 10 * tolerance  # the cap matters
    for t in range(new):
        alone = kernels.decode_attention(q[:, :, t : t + 1], k, v, [start + t], softcap=cap)
        assert torch.equal(got[:, :, t : t + 1], alone)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        kernels.decode_attention(q, k, v, [start], softcap=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_tree_attention_gives_each_path_the_chain_bits(
    dtype: torch.dtype, kernel_path: str
) -> None:
    """A tree after 40 cached slots with a window of 16: each node reads what a chain pass over
    its own path reads (the prefix's last slots in its window, then its ancestors), bit for
    bit; a tree deeper than the window is refused."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, prefix, window = 4, 2, 64, 40, 16
    parents = [-1, 0, 0, 1, 3]
    nodes = len(parents)
    paths = []
    for node in range(nodes):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths.append(path)
    mask = torch.zeros(1, nodes, nodes, dtype=torch.bool)
    for node, path in enumerate(paths):
        mask[0, node, path] = True
    q = torch.randn(1, heads, nodes, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, prefix + nodes, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, prefix + nodes, dim, generator=gen).to(dtype)
    got = kernels.decode_attention(q, k, v, [prefix], [prefix], mask, window=window)
    for node, path in enumerate(paths):
        keep = list(range(prefix)) + [prefix + p for p in path]
        position = prefix + len(path) - 1
        chain = kernels.decode_attention(
            q[:, :, node : node + 1], k[:, :, keep], v[:, :, keep], [position], window=window
        )
        assert torch.equal(got[:, :, node : node + 1], chain), node
    with pytest.raises(RuntimeError, match="a tree deeper than the window 3"):
        kernels.decode_attention(q, k, v, [prefix], [prefix], mask, window=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_paged_attention_gives_the_rectangular_bits(
    dtype: torch.dtype, tree: bool, kernel_path: str
) -> None:
    """The same keys and values in blocks of 16 scattered over a pool (shuffled, with blocks
    no row uses), read through a block table: the rectangular cache's bits, chain and tree."""
    gen = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, new, slots, dim, size = 3, 4, 2, 5, 70, 64, 16
    per_row = -(-slots // size)
    q = torch.randn(rows, heads, new, dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, slots, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, slots, dim, generator=gen).to(dtype)
    order = torch.randperm(rows * per_row + 5, generator=gen)
    table = order[: rows * per_row].view(rows, per_row)  # [B, max_blocks]
    pools = []
    for x in (k, v):
        padded = torch.zeros(rows, kv_heads, per_row * size, dim, dtype=dtype)
        padded[:, :, :slots] = x
        blocks = padded.view(rows, kv_heads, per_row, size, dim).transpose(1, 2)
        pool = torch.randn(len(order), kv_heads, size, dim, generator=gen).to(dtype)
        pool[table.flatten()] = blocks.reshape(-1, kv_heads, size, dim)
        pools.append(pool)
    starts = [60, 0, 33]
    mask, tree_starts = None, ()
    if tree:
        tree_starts = [55, 0, 30]
        mask = torch.rand(rows, new, 15, generator=gen) < 0.5
        for b, (start, first) in enumerate(zip(starts, tree_starts, strict=True)):
            offset = start - first
            mask[b, :, offset + new :] = False
            for t in range(new):
                mask[b, t, offset + t] = True
                mask[b, t, offset + t + 1 :] = False
    want = kernels.decode_attention(q, k, v, starts, tree_starts, mask)
    got = kernels.decode_attention(q, *pools, starts, tree_starts, mask, table)
    assert torch.equal(got, want)


def test_decode_attention_checks_its_arguments() -> None:
    q, kv = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 10, 16)
    with pytest.raises(RuntimeError, match="slots 9 \\+ 2 need 2 blocks of 10, the table holds 1"):
        kernels.decode_attention(q, kv, kv, [9])
    pool = torch.randn(3, 2, 16, 16)
    with pytest.raises(RuntimeError, match="block 7 is outside the pool's 3"):
        kernels.decode_attention(q, pool, pool, [1], (), None, torch.tensor([[7]]))
    with pytest.raises(RuntimeError, match="block_table must be a contiguous int64"):
        kernels.decode_attention(
            q, pool, pool, [1], (), None, torch.tensor([[0]], dtype=torch.int32)
        )
    with pytest.raises(RuntimeError, match="one start per batch row"):
        kernels.decode_attention(q, kv, kv, [1, 2])
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        kernels.decode_attention(q, kv, kv, [1], window=-1)
    with pytest.raises(RuntimeError, match="decode_attention takes fp32 or bf16"):
        kernels.decode_attention(q.double(), kv.double(), kv.double(), [1])


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_torch_and_is_row_exact(
    dtype: torch.dtype, tolerance: float, kernel_path: str
) -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 72, generator=gen) * 4).to(dtype)
    weight = torch.randn(72, generator=gen).to(dtype)
    got = kernels.rms_norm(x, weight, 1e-6)
    x32 = x.float()
    want = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(kernels.rms_norm(x[1:2, 3:4], weight, 1e-6), got[1:2, 3:4])
    with pytest.raises(RuntimeError, match="weight must be \\[72\\] in x's dtype"):
        kernels.rms_norm(x, weight[:70], 1e-6)


def test_rms_norm_applies_an_fp32_weight_before_rounding(kernel_path: str) -> None:
    """Gemma's norms: bf16 x, the fp32 factor 1 + w applied before rounding to bf16, as
    RMSNorm's torch route (and Gemma's reference) does; row-exact too."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 5, 72, generator=gen) * 4).bfloat16()
    weight = 1.0 + torch.randn(72, generator=gen) * 0.3  # [72] fp32
    got = kernels.rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.bfloat16
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)  # [3, 5, 72] fp32
    want = (normed * weight).bfloat16()
    rounded_first = weight.bfloat16() * normed.bfloat16()  # Llama's order
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    same = (got == want).float().mean().item()
    assert same > 0.99 and (got == rounded_first).float().mean().item() < same - 0.1
    assert torch.equal(kernels.rms_norm(x[2:3, 1:2], weight, 1e-6), got[2:3, 1:2])
    with pytest.raises(RuntimeError, match="in x's dtype or fp32"):
        kernels.rms_norm(x, weight.half(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rounds_exactly_as_the_torch_rotation(dtype: torch.dtype, kernel_path: str) -> None:
    """In place on the q and k heads of a fused q/k/v row; the v heads are left alone."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 4, 2, 32
    qkv = torch.randn(2, 5, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    rotary = Rotary(dim, 10000.0, 64)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    cos, sin = rotary.tables(positions, None)  # [2, 5, D] fp32
    q = qkv[..., : heads * dim].view(2, 5, heads, dim).transpose(1, 2)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(2, 5, kv_heads, dim).transpose(1, 2)
    cos_t, sin_t = rotary.tables(positions, dtype)  # [2, 1, 5, D] in dtype, for `rotate`
    want_q, want_k = rotate(q, cos_t, sin_t), rotate(k, cos_t, sin_t)
    v_before = qkv[..., (heads + kv_heads) * dim :].clone()
    kernels.rope_(qkv, cos, sin, heads + kv_heads)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # q, k: views of the rotated qkv
    assert torch.equal(qkv[..., (heads + kv_heads) * dim :], v_before)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous fp32"):
        kernels.rope_(qkv, cos.bfloat16(), sin, heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_gives_torchs_index_ties_nans_and_infinities_included(
    dtype: torch.dtype, kernel_path: str
) -> None:
    """The first largest value's index per row, a NaN counting as the largest, as
    torch.argmax(-1); over widths below, at and past a vector, and a vocabulary's."""
    gen = torch.Generator().manual_seed(8)
    for width in (1, 7, 8, 9, 100, 49_152):
        x = torch.randn(6, width, generator=gen)
        x[1] = torch.randint(0, 3, (width,), generator=gen).float()  # ties
        x[2, width // 2] = x[2, -1] = float("nan")
        x[3] = float("-inf")
        x[4, -1] = float("inf")
        x[5, ::2] = 0.0
        x[5, 1::2] = -0.0
        x = x.to(dtype)
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), width
    batch = torch.randn(2, 3, 40, generator=gen).to(dtype)
    assert torch.equal(kernels.argmax(batch), batch.argmax(-1))  # [2, 3]
    strided = batch[..., ::2]
    assert torch.equal(kernels.argmax(strided), strided.argmax(-1))
    with pytest.raises(RuntimeError, match=r"argmax needs x \[\.\.\., N\] with N >= 1"):
        kernels.argmax(torch.zeros(3, 0, dtype=dtype))


def test_the_samplers_argmax_takes_any_logits() -> None:
    """`sampling.argmax`: the native pass for fp32 / bf16 CPU logits, torch's for the rest."""
    from specdecode.sampling.argmax import argmax

    logits = torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(9))
    for x in (logits, logits.bfloat16(), logits.half(), logits.double(), logits[..., ::3]):
        assert torch.equal(argmax(x), x.argmax(-1))
