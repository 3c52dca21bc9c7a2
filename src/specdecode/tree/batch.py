"""How a batch of tree drafts is laid out for one verification pass.

Row b feeds `[last, node 0, .., node k_b - 1]` (padded to one width T = 1 + N): the last
committed token at slot starts[b] and position starts[b], node n at slot starts[b] + 1 + n and
position starts[b] + depth(n). The last token sees the cached prefix and itself; a node sees
the prefix, the last token, its ancestors and itself; a padding token sees the prefix, the last
token and itself (it is never kept). Worked example, one row at start 10, parents (-1, -1, 0):

    pass index   0 (last)  1 (n0)  2 (n1)  3 (n2)
    position     10        11      11      12
    mask row 3   [1, 1, 0, 1]      (n2 sees last, n0 and itself)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.tree.token_tree import TokenTree


def tree_metadata(
    starts: Sequence[int],
    trees: Sequence[TokenTree],
    width: int,
    device: torch.device | str,
    max_positions: int,
) -> AttentionMetadata:
    """The TREE pass over `[last, nodes...]` of every row (see the module docstring).

    starts: per row, its cached length; trees: per row, its draft's shape; width: T >= 1 +
    every tree's nodes; max_positions: positions are clamped below it (padding only: a real
    node's position is at most its slot).
    """
    batch = len(trees)
    mask = torch.zeros(batch, width, width, dtype=torch.bool)  # [B, T, T]
    mask[:, :, 0] = True  # everyone sees the last committed token
    mask[:, torch.arange(width), torch.arange(width)] = True  # and itself
    depths = torch.arange(width).repeat(batch, 1)  # [B, T]: padding keeps its index
    for row, tree in enumerate(trees):
        k = tree.num_nodes
        mask[row, 1 : k + 1, 1 : k + 1] = tree.ancestor_mask()
        depths[row, 1 : k + 1] = torch.tensor(tree.depths, dtype=torch.long)
    positions = torch.tensor(list(starts))[:, None] + depths  # [B, T]
    positions = positions.clamp(max=max_positions - 1).to(device)
    num_new = tuple(1 + t.num_nodes for t in trees)
    return AttentionMetadata(AttentionMode.TREE, tuple(starts), num_new, positions, mask.to(device))


def kept_offsets(paths: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per row, the pass offsets to keep after a verdict: the last token (0) and the accepted
    nodes (node n sits at offset n + 1). Example: path (1, 4) -> [0, 2, 5]."""
    return [[0, *(n + 1 for n in path)] for path in paths]
