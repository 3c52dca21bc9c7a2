"""Our transformer and KV cache against Hugging Face transformers (fp32) on tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specdecode.model import transformer
from specdecode.model.loading import load_model
from specdecode.model.transformer import Transformer, _grouped_attention


def _run(model: Transformer, tokens: torch.Tensor, start: int = 0, cache=None):
    """Feed tokens ([B, T]) at positions start.. into `cache` (a new one if None)."""
    cache = cache if cache is not None else model.new_cache(tokens.shape[0], 128)
    positions = torch.arange(start, start + tokens.shape[1]).expand(tokens.shape[0], -1)
    logits, hidden = model(tokens, positions, cache)
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
    logits, _, _ = _run(ours, padded, cache=cache)
    cache.truncate([9, 5])
    nxt = torch.tensor([[7], [11]])
    step, _ = ours(nxt, torch.tensor([[9], [5]]), cache)
    alone_a, _, _ = _run(ours, torch.cat([a, nxt[:1]], dim=1))
    alone_b, _, _ = _run(ours, torch.cat([b, nxt[1:]], dim=1))
    torch.testing.assert_close(logits[0], alone_a[0, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :5], alone_b[0, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[0, 0], alone_a[0, 9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1, 0], alone_b[0, 5], atol=1e-5, rtol=1e-5)


def test_explicit_mask_equal_to_causal_matches_default(models) -> None:
    ours, _ = models
    tokens = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(5))
    _, _, cache = _run(ours, tokens[:, :3])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    masked, _ = ours(tokens[:, 3:], torch.arange(3, 6)[None], cache, mask=causal)
    full, _, _ = _run(ours, tokens)
    torch.testing.assert_close(masked, full[:, 3:], atol=1e-5, rtol=1e-5)


def test_logits_index_and_exit_layer(models) -> None:
    ours, _ = models
    tokens = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(6))
    full, _, _ = _run(ours, tokens)
    positions = torch.arange(7).expand(2, -1)
    picked, _ = ours(
        tokens, positions, ours.new_cache(2, 16), logits_index=torch.tensor([[6], [2]])
    )
    torch.testing.assert_close(picked[:, 0], torch.stack([full[0, 6], full[1, 2]]))
    early, hidden = ours(tokens, positions, ours.new_cache(2, 16), exit_layer=1)
    assert early.shape == full.shape and hidden.shape[:2] == (2, 7)
    assert not torch.allclose(early, full)
    with pytest.raises(ValueError, match="exit_layer"):
        ours(tokens, positions, ours.new_cache(2, 16), exit_layer=99)


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


def test_cache_capacity_and_truncate_errors(models) -> None:
    ours, _ = models
    cache = ours.new_cache(1, 4)
    _run(ours, torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match="KV cache full"):
        _run(ours, torch.tensor([[4, 5]]), start=3, cache=cache)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(5)


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


def test_bf16_decoding_through_grouped_attention(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's bf16 decode path over a long cache (grouped attention) agrees with SDPA."""
    model = load_model(tiny_model_dir, dtype="bfloat16")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(9))

    def decode(long_span: int) -> torch.Tensor:
        monkeypatch.setattr(transformer, "LONG_SPAN", long_span)
        logits, _, cache = _run(model, tokens[:, :4])
        steps = [_run(model, tokens[:, i : i + 1], start=i, cache=cache)[0] for i in range(4, 12)]
        return torch.cat([logits, *steps], dim=1).float()

    grouped, sdpa = decode(1), decode(10**9)
    assert not torch.equal(grouped, sdpa)  # two different kernels really ran
    assert (grouped - sdpa).abs().max() < 0.02 * sdpa.abs().max()
