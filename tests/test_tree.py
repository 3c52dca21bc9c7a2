"""Token trees: their shape, the TREE pass (each node gets what a chain pass over its own path
gives: bit for bit in bf16 and int8) and `compact`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.model.loading import load_model
from specdecode.model.transformer import Transformer
from specdecode.tree.batch import kept_offsets, tree_metadata
from specdecode.tree.token_tree import TokenTree

FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8")}


def test_token_tree_shape() -> None:
    tree = TokenTree((-1, -1, 0, 2, 0))
    assert tree.depths == (1, 1, 2, 3, 2)
    assert tree.children[-1] == (0, 1) and tree.children[0] == (2, 4) and tree.children[1] == ()
    assert tree.path(3) == (0, 2, 3) and tree.depth == 3 and not tree.is_chain
    assert TokenTree.chain(3).parents == (-1, 0, 1) and TokenTree.chain(3).is_chain
    mask = tree.ancestor_mask()
    assert mask[3].tolist() == [True, False, True, True, False]
    assert mask.sum().item() == 1 + 1 + 2 + 3 + 2
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((-1, 1))
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((-2,))


def test_tree_metadata_worked_example() -> None:
    meta = tree_metadata([10], [TokenTree((-1, -1, 0))], 5, "cpu", 256)
    assert meta.mode is AttentionMode.TREE and meta.num_new == (4,)
    assert meta.positions.tolist() == [[10, 11, 11, 12, 14]]  # the last one is padding
    assert meta.tree_mask[0, 3].tolist() == [True, True, False, True, False]
    assert meta.tree_mask[0, 4].tolist() == [True, False, False, False, True]
    assert kept_offsets([(1,), ()]) == [[0, 2], [0]]


def _prefilled(model: Transformer, prefixes: list[torch.Tensor], capacity: int = 64):
    """A cache holding each row's prefix (fed in DECODE mode: the same bits whatever the batch)."""
    lengths = [len(p) for p in prefixes]
    tokens = torch.zeros(len(prefixes), max(lengths), dtype=torch.long)
    for row, prefix in enumerate(prefixes):
        tokens[row, : len(prefix)] = prefix
    cache = model.new_cache(len(prefixes), capacity)
    meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [0] * len(prefixes), lengths, "cpu")
    model(tokens, meta, cache)
    return cache


def _chain_logits(model: Transformer, prefix: torch.Tensor, path: list[int]) -> torch.Tensor:
    """[len(path), V]: logits after each token of `path` fed after `prefix` (a chain pass)."""
    cache = _prefilled(model, [prefix])
    tokens = torch.tensor([path])
    meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [len(prefix)], [len(path)], "cpu")
    return model(tokens, meta, cache)[0][0]


def _random_tree(num: int, gen: torch.Generator) -> TokenTree:
    return TokenTree(tuple(int(torch.randint(-1, i, (1,), generator=gen)) for i in range(num)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_tree_pass_gives_each_node_its_chain_logits(tiny_model_dir: Path, fmt: str) -> None:
    """Batched rows with different trees, sizes and starts: node n's logits equal those of a
    chain pass over [last, path to n] (bit for bit where the kernels are row-exact)."""
    dtype, quantization = FORMATS[fmt]
    model = load_model(tiny_model_dir, dtype=dtype, quantization=quantization)
    gen = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 300, (n,), generator=gen) for n in (9, 4)]
    trees = [_random_tree(7, gen), _random_tree(4, gen)]
    nodes = [torch.randint(0, 300, (t.num_nodes,), generator=gen) for t in trees]
    cache = _prefilled(model, [p[:-1] for p in prefixes])
    starts = [len(p) - 1 for p in prefixes]
    tokens = torch.zeros(2, 8, dtype=torch.long)
    for row, (prefix, node_tokens) in enumerate(zip(prefixes, nodes, strict=True)):
        tokens[row, 0] = prefix[-1]
        tokens[row, 1 : 1 + len(node_tokens)] = node_tokens
    logits, _ = model(tokens, tree_metadata(starts, trees, 8, "cpu", 256), cache)
    for row, (prefix, tree, node_tokens) in enumerate(zip(prefixes, trees, nodes, strict=True)):
        for node in range(-1, tree.num_nodes):
            path = tree.path(node) if node >= 0 else ()
            chain = [int(prefix[-1]), *(int(node_tokens[n]) for n in path)]
            expected = _chain_logits(model, prefix[:-1], chain)[-1]
            got = logits[row, node + 1]
            if fmt == "fp32":
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, expected), (row, node)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_tree_grown_over_two_passes(tiny_model_dir: Path, fmt: str) -> None:
    """tree_starts lets a second pass see the nodes the first one cached (its ancestors only)."""
    dtype, quantization = FORMATS[fmt]
    model = load_model(tiny_model_dir, dtype=dtype, quantization=quantization)
    prefix = torch.tensor([5, 17, 42, 99, 3])
    cache = _prefilled(model, [prefix])
    level1 = torch.tensor([[7, 8, 9]])  # three children of the root at slots 5, 6, 7
    first = AttentionMetadata(
        AttentionMode.TREE, (5,), (3,), torch.full((1, 3), 5), torch.eye(3, dtype=torch.bool)[None]
    )
    model(level1, first, cache)
    # level 2: children of node 1 (token 8) and of node 2 (token 9), at slots 8, 9
    mask = torch.tensor([[[0, 1, 0, 1, 0], [0, 0, 1, 0, 1]]], dtype=torch.bool)
    second = AttentionMetadata(
        AttentionMode.TREE, (8,), (2,), torch.full((1, 2), 6), mask, tree_starts=(5,)
    )
    logits, _ = model(torch.tensor([[11, 12]]), second, cache)
    for col, path in enumerate([[8, 11], [9, 12]]):
        expected = _chain_logits(model, prefix, path)[-1]
        assert torch.equal(logits[0, col], expected), col


def test_compact_keeps_exactly_the_path(tiny_model_dir: Path) -> None:
    """After a tree pass, `compact` leaves the cache's keys and values as a chain pass over the
    kept path leaves them (bit for bit in int8), and later slots are free."""
    model = load_model(tiny_model_dir, dtype="bfloat16", quantization="int8")
    prefix = torch.tensor([5, 17, 42, 99])
    tree = TokenTree((-1, -1, 1, 0, 2))
    nodes = torch.tensor([[40, 41, 42, 43, 44]])
    cache = _prefilled(model, [prefix[:-1]])
    tokens = torch.cat([prefix[-1:][None], nodes], dim=1)
    model(tokens, tree_metadata([3], [tree], 6, "cpu", 256), cache)
    path = tree.path(4)  # (1, 2, 4)
    cache.compact([3], kept_offsets([path]))
    assert cache.lengths == [3 + 1 + len(path)]
    chain = _prefilled(model, [torch.cat([prefix, nodes[0, list(path)]])])
    assert cache.lengths == chain.lengths
    for got, want in zip(cache.gather(0), chain.gather(0), strict=True):
        assert torch.equal(got, want)


def test_a_tree_mask_may_show_a_query_the_later_slots_of_its_pass() -> None:
    """A block drafter's pass (`heads.dflash`): every new token sees every other; each query
    then attends as a batched attention over the cached slots and the whole block."""
    from specdecode import kernels

    if not kernels.available():
        pytest.skip("no native kernels here")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=gen)  # [B, H, T, D]: 3 new tokens at slots 5..7
    k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(2))  # [B, Hkv, S, D]
    block = torch.ones(1, 3, 3, dtype=torch.bool)
    got = kernels.decode_attention(q, k, v, [5], [5], block)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_attention_kernel_refuses_a_bad_tree_mask() -> None:
    from specdecode import kernels

    if not kernels.available():
        pytest.skip("no native kernels here")
    q = torch.zeros(1, 2, 2, 16)
    kv = torch.zeros(1, 2, 8, 16)
    sees_later = torch.tensor([[[1, 1], [0, 1]]], dtype=torch.bool)
    with pytest.raises(RuntimeError, match="later slot 4 under a window"):
        kernels.decode_attention(q, kv, kv, [3], [3], sees_later, None, 4)
    past_the_pass = torch.tensor([[[1, 0, 1], [0, 1, 0]]], dtype=torch.bool)
    with pytest.raises(RuntimeError, match="slot 5, past the pass's last"):
        kernels.decode_attention(q, kv, kv, [3], [3], past_the_pass)
    blind = torch.tensor([[[1, 0], [1, 0]]], dtype=torch.bool)
    with pytest.raises(RuntimeError, match="see itself"):
        kernels.decode_attention(q, kv, kv, [3], [3], blind)
