"""The check that a model's decoder blocks give the same bits as one native call each
(`Block.native`) as run op by op from Python, over DECODE and TREE passes."""

from __future__ import annotations

import torch

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.model.transformer import Transformer


def assert_native_blocks_give_python_bits(
    model: Transformer, vocab: int, prompt: int = 6, seed: int = 21
) -> None:
    """Two rows prefilled with `prompt` and `prompt` - 2 tokens, a DECODE pass (4 and 3 new
    tokens at different starts) and a TREE pass (3 nodes, two siblings) run with every block
    as its native call, then again op by op: logits and cache are bit for bit the same. (A
    prefill pass runs op by op either way.)"""
    assert all(block.native is not None for block in model.layers)
    gen = torch.Generator().manual_seed(seed)
    prompt_tokens = torch.randint(0, vocab, (2, prompt), generator=gen)
    decode_tokens = torch.randint(0, vocab, (2, 4), generator=gen)
    tree_tokens = torch.randint(0, vocab, (2, 3), generator=gen)
    parents_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    lengths = [prompt, prompt - 2]

    def run() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        cache = model.new_cache(2, prompt + 16)
        prefill = AttentionMetadata.contiguous(AttentionMode.PREFILL, [0, 0], lengths, "cpu")
        outs = [model(prompt_tokens, prefill, cache)[0]]
        decode = AttentionMetadata.contiguous(AttentionMode.DECODE, lengths, [4, 3], "cpu")
        outs.append(model(decode_tokens, decode, cache)[0])
        starts = (lengths[0] + 4, lengths[1] + 3)
        positions = torch.tensor([[s, s + 1, s + 1] for s in starts])  # [2, 3]
        tree = AttentionMetadata(
            AttentionMode.TREE, starts, (3, 3), positions, parents_mask.expand(2, 3, 3)
        )
        outs.append(model(tree_tokens, tree, cache)[0])
        (k0, v0), (k1, v1) = cache.gather(0), cache.gather(1)
        return outs, torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)

    native = run()
    natives = [block.native for block in model.layers]
    for block in model.layers:
        block.native = None
    try:
        python = run()
    finally:
        for block, layer in zip(model.layers, natives, strict=True):
            block.native = layer
    for got, want in zip(native[0], python[0], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(native[1], python[1]) and torch.equal(native[2], python[2])
