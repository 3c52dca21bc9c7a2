"""Our transformer and KV cache against Hugging Face transformers (fp32) on tiny random models."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.model import attention
from specdecode.model.attention import _grouped_attention
from specdecode.model.loading import load_model
from specdecode.model.transformer import Transformer


def _meta(starts: list[int], width: int, mode: AttentionMode | None = None) -> AttentionMetadata:
    """Rows continuing at `starts` with `width` new tokens each (prefill when all start at 0)."""
    if mode is None:
        mode = AttentionMode.PREFILL if not any(starts) else AttentionMode.DECODE
    return AttentionMetadata.contiguous(mode, starts, [width] * len(starts), "cpu")


def _run(model: Transformer, tokens: torch.Tensor, start: int = 0, cache=None):
    """Feed tokens ([B, T]) at positions start.. into `cache` (a new one if None)."""
    cache = cache if cache is not None else model.new_cache(tokens.shape[0], 128)
    logits, hidden = model(tokens, _meta([start] * tokens.shape[0], tokens.shape[1]), cache)
    return logits, hidden, cache


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[Transformer, torch.nn.Module]:
    ours = load_model(tiny_model_dir, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ours, ref


def test_logits_match_hf(models) -> None:
    ours, ref = models
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens).logits
    logits, hidden, _ = _run(ours, tokens)
    assert logits.shape == expected.shape
    assert hidden.shape == (2, 17, ours.config.hidden_size)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_incremental_decoding_matches_full_pass(models) -> None:
    ours, _ = models
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    full, _, _ = _run(ours, tokens)
    _, _, cache = _run(ours, tokens[:, :5])
    steps = [_run(ours, tokens[:, i : i + 1], start=i, cache=cache)[0] for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 5:], atol=1e-5, rtol=1e-5)


def test_truncate_then_rewrite_equals_fresh_run(models) -> None:
    ours, _ = models
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 300, (1, 8), generator=gen)
    wrong = torch.randint(0, 300, (1, 4), generator=gen)
    right = torch.randint(0, 300, (1, 4), generator=gen)
    _, _, cache = _run(ours, prefix)
    _run(ours, wrong, start=8, cache=cache)  # e.g. a rejected draft
    assert cache.lengths == [12]
    cache.truncate(8)
    rewritten, _, _ = _run(ours, right, start=8, cache=cache)
    fresh, _, _ = _run(ours, torch.cat([prefix, right], dim=1))
    torch.testing.assert_close(rewritten, fresh[:, 8:], atol=1e-5, rtol=1e-5)


def test_batch_rows_with_different_lengths_match_single_rows(models) -> None:
    ours, _ = models
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(0, 300, (1, 9), generator=gen)
    b = torch.randint(0, 300, (1, 5), generator=gen)
    cache = ours.new_cache(2, 64)
    padded = torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], dim=1)])
    logits, _ = ours(padded, AttentionMetadata.prefill([9, 5], "cpu"), cache)
    assert cache.lengths == [9, 5]  # the padding is not kept
    nxt = torch.tensor([[7], [11]])
    step, _ = ours(nxt, _meta([9, 5], 1), cache)
    alone_a, _, _ = _run(ours, torch.cat([a, nxt[:1]], dim=1))
    alone_b, _, _ = _run(ours, torch.cat([b, nxt[1:]], dim=1))
    torch.testing.assert_close(logits[0], alone_a[0, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :5], alone_b[0, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[0, 0], alone_a[0, 9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1, 0], alone_b[0, 5], atol=1e-5, rtol=1e-5)


def test_a_causal_tree_mask_matches_the_chain(models) -> None:
    ours, _ = models
    tokens = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(5))
    _, _, cache = _run(ours, tokens[:, :3])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    meta = AttentionMetadata(AttentionMode.TREE, (3,), (3,), torch.arange(3, 6)[None], causal)
    masked, _ = ours(tokens[:, 3:], meta, cache)
    full, _, _ = _run(ours, tokens)
    torch.testing.assert_close(masked, full[:, 3:], atol=1e-5, rtol=1e-5)


def test_logits_index_and_exit_layer(models) -> None:
    ours, _ = models
    tokens = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(6))
    full, _, _ = _run(ours, tokens)
    meta = _meta([0, 0], 7)
    picked, _ = ours(tokens, meta, ours.new_cache(2, 16), logits_index=torch.tensor([[6], [2]]))
    torch.testing.assert_close(picked[:, 0], torch.stack([full[0, 6], full[1, 2]]))
    early, hidden = ours(tokens, meta, ours.new_cache(2, 16), exit_layer=1)
    assert early.shape == full.shape and hidden.shape[:2] == (2, 7)
    assert not torch.allclose(early, full)
    with pytest.raises(ValueError, match="exit_layer"):
        ours(tokens, meta, ours.new_cache(2, 16), exit_layer=99)


def test_bfloat16_close_to_float32(tiny_model_dir: Path) -> None:
    fp32 = load_model(tiny_model_dir, dtype="float32")
    bf16 = load_model(tiny_model_dir, dtype="bfloat16")
    assert bf16.rotary.cos.dtype == torch.float32  # RoPE tables are never rounded
    tokens = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(7))
    ref, _, _ = _run(fp32, tokens)
    got, _, _ = _run(bf16, tokens)
    assert got.dtype == torch.bfloat16
    scale = ref.abs().max()
    assert (got.float() - ref).abs().max() < 0.05 * scale


def test_cache_limit_and_truncate_errors(models) -> None:
    ours, _ = models
    cache = ours.new_cache(1, 4, max_tokens=16)  # one block
    _run(ours, torch.tensor([[1] * 15]), cache=cache)
    with pytest.raises(ValueError, match="KV cache full"):
        _run(ours, torch.tensor([[4, 5]]), start=15, cache=cache)
    assert cache.lengths == [15]
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(16)


@pytest.mark.parametrize("num_new", [1, 3, 16])
def test_grouped_attention_matches_sdpa(num_new: int) -> None:
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 6, num_new, 32, generator=gen)
    k = torch.randn(2, 2, 20, 32, generator=gen)
    v = torch.randn(2, 2, 20, 32, generator=gen)
    mask = torch.rand(2, 1, num_new, 20, generator=gen) > 0.3
    mask[..., 0] = True  # every query sees at least one slot
    for m in (None, mask):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        got = _grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), m)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(_grouped_attention(q, k, v, m), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_new", [2, 37, 300])
def test_causal_route_gives_the_masked_routes_bits(dtype: torch.dtype, num_new: int) -> None:
    """A square causal mask (a prompt into an empty row) runs through SDPA's own causal path,
    which skips the key blocks past the diagonal: the same bits as reading the mask, alone and
    row by row (300: past the CPU kernel's key blocks). pass_view marks only that mask causal."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 6, num_new, 32, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, num_new, 32, generator=gen).to(dtype) for _ in range(2))
    mask = torch.ones(num_new, num_new, dtype=torch.bool).tril()[None, None]
    masked = attention.attend(q, k, v, mask)
    assert torch.equal(attention.attend(q, k, v, mask, causal=True), masked)
    rows = ((num_new, num_new),)
    assert torch.equal(attention._rowwise_attention(q, k, v, mask, rows, causal=True), masked)
    layer = types.SimpleNamespace(per_query=False, rope_tables=lambda *args: (None, None))
    view = attention.pass_view(layer, None, _meta([0], num_new), dtype)[0]
    assert view.causal and torch.equal(view.mask, mask)
    later = AttentionMetadata.contiguous(AttentionMode.PREFILL, [3], [num_new], "cpu")
    assert not attention.pass_view(layer, None, later, dtype)[0].causal  # a cached prefix


def test_bf16_decoding_through_grouped_attention(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's bf16 decode path over a long cache (grouped attention) agrees with SDPA."""
    model = load_model(tiny_model_dir, dtype="bfloat16")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(9))

    def decode(long_span: int) -> torch.Tensor:
        monkeypatch.setattr(attention, "LONG_SPAN", long_span)
        logits, _, cache = _run(model, tokens[:, :4])
        steps = [_run(model, tokens[:, i : i + 1], start=i, cache=cache)[0] for i in range(4, 12)]
        return torch.cat([logits, *steps], dim=1).float()

    grouped, sdpa = decode(1), decode(10**9)
    assert not torch.equal(grouped, sdpa)  # two different kernels really ran
    assert (grouped - sdpa).abs().max() < 0.02 * sdpa.abs().max()


def test_hidden_layers_are_the_inputs_of_those_blocks(models) -> None:
    """hidden_layers=(i, ...) returns the inputs of blocks i, ... (HF's hidden_states[i]); the
    index L is the final-normed output, HF's last entry."""
    ours, ref = models
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = ref(tokens, output_hidden_states=True).hidden_states
    layers = ours.config.num_layers
    wanted = (layers, 0, 2)
    logits, hidden = ours(tokens, _meta([0, 0], 9), ours.new_cache(2, 16), hidden_layers=wanted)
    plain, final = ours(tokens, _meta([0, 0], 9), ours.new_cache(2, 16))
    width = ours.config.hidden_size
    assert hidden.shape == (2, 9, 3 * width)
    torch.testing.assert_close(logits, plain)  # the logits do not change
    torch.testing.assert_close(hidden[..., :width], final)
    for part, index in enumerate(wanted):
        got = hidden[..., part * width : (part + 1) * width]
        torch.testing.assert_close(got, expected[index], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="hidden_layers"):
        ours(tokens, _meta([0, 0], 9), ours.new_cache(2, 16), hidden_layers=(layers + 1,))


def test_decode_mode_gives_a_mixed_batch_what_each_row_gets_alone(tiny_model_dir: Path) -> None:
    """DECODE is row-exact for any starts: a fresh row (start 0) next to a running row gets,
    bit for bit in bf16, what it gets from one-token steps alone."""
    model = load_model(tiny_model_dir, dtype="bfloat16")
    decode = AttentionMode.DECODE
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(11))
    prefix = ids[1:, :7]  # row 1 has 7 cached tokens, row 0 none
    cache = model.new_cache(2, 32)
    model(ids[:, :7], AttentionMetadata.contiguous(decode, [0, 0], [0, 7], "cpu"), cache)
    new = torch.stack([ids[0, :4], ids[1, 7:11]])  # [2, 4]
    mixed, _ = model(new, AttentionMetadata.contiguous(decode, [0, 7], [4, 4], "cpu"), cache)
    for row, start in enumerate([0, 7]):
        alone = model.new_cache(1, 32)
        if start:
            model(prefix, _meta([0], 7, decode), alone)
        steps = [
            model(new[row : row + 1, t : t + 1], _meta([start + t], 1, decode), alone)[0]
            for t in range(4)
        ]
        assert torch.equal(mixed[row], torch.cat(steps, 1)[0]), row


def test_compact_keeps_a_path_as_if_it_had_been_fed_alone(models) -> None:
    """Tree nodes written at consecutive slots, then compacted to one root-to-leaf path, leave
    the cache as a chain pass over that path would."""
    ours, _ = models
    gen = torch.Generator().manual_seed(12)
    prefix = torch.randint(0, 300, (1, 5), generator=gen)
    nodes = torch.randint(0, 300, (1, 4), generator=gen)  # tree: 0 -> 1, 0 -> 2 -> 3
    parents = [-1, 0, 0, 2]
    mask = torch.eye(4, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            mask[node, parent] = True
            parent = parents[parent]
    _, _, cache = _run(ours, prefix)
    depths = torch.tensor([[5, 6, 6, 7]])
    ours(nodes, AttentionMetadata(AttentionMode.TREE, (5,), (4,), depths, mask[None]), cache)
    cache.compact([5], [[0, 2, 3]])
    assert cache.lengths == [8]
    nxt = torch.tensor([[42]])
    after, _ = ours(nxt, _meta([8], 1), cache)
    chain = torch.cat([prefix, nodes[:, [0, 2, 3]], nxt], dim=1)
    fresh, _, _ = _run(ours, chain)
    torch.testing.assert_close(after[:, 0], fresh[:, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kept offsets"):
        cache.compact([5], [[2, 1]])


def test_load_prefix_copies_one_row_into_every_row(models) -> None:
    ours, _ = models
    tokens = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(13))
    _, _, source = _run(ours, tokens)
    copies = ours.new_cache(3, 32)
    copies.load_prefix(source, 5)
    assert copies.lengths == [5, 5, 5]
    want_k, want_v = source.gather(0)
    for row in range(3):
        got_k, got_v = copies.gather(row)
        assert torch.equal(got_k, want_k[:, :, :5]) and torch.equal(got_v, want_v[:, :, :5])
    with pytest.raises(ValueError, match="cannot load 7 slots"):
        copies.load_prefix(source, 7)


def test_metadata_and_cache_refuse_what_does_not_fit(models) -> None:
    ours, _ = models
    with pytest.raises(ValueError, match="one entry per row"):
        AttentionMetadata(AttentionMode.DECODE, (0,), (1, 1), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="tree_mask"):
        AttentionMetadata(AttentionMode.TREE, (0,), (1,), torch.zeros(1, 1, dtype=torch.long))
    cache = ours.new_cache(1, 16)
    with pytest.raises(ValueError, match="truncate the cache first"):
        ours(torch.tensor([[1]]), _meta([3], 1), cache)
    with pytest.raises(ValueError, match="do not match"):
        ours(torch.tensor([[1, 2]]), _meta([0], 1), cache)


@pytest.fixture(scope="module")
def gguf_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_cases import build_tiny_gguf

    return build_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "model")


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        ("bfloat16", None),
        ("float32", "int8"),
        ("bfloat16", "int8"),
        ("float32", "gguf"),
        ("bfloat16", "gguf"),
    ],
)
def test_native_blocks_give_the_python_blocks_bits(
    tiny_model_dir: Path, gguf_model_dir: Path, dtype: str, quantization: str | None
) -> None:
    """A DECODE pass over rows at different starts and a TREE pass run each block as one
    native call (`Block.native`); logits and cache are bit for bit what the Python blocks
    give. A prefill pass keeps the Python blocks."""
    from native_blocks import assert_native_blocks_give_python_bits

    folder = gguf_model_dir if quantization == "gguf" else tiny_model_dir
    model = load_model(folder, dtype, quantization=quantization)
    assert_native_blocks_give_python_bits(model, 300)
