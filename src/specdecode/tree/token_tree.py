"""The shape of a tree draft: a parent index per node, and everything derived from it once.

Nodes are numbered 0..N-1 in topological order (a parent before its children); parent -1 means
a child of the root, the last committed token. A chain of K tokens is `parents = (-1, 0, ..,
K - 2)`. Worked example, two branches of which the first has a continuation:

    parents (-1, -1, 0)        root --- 0 --- 2
                                    \\-- 1
    depths (1, 1, 2); children of the root (0, 1), of node 0 (2,); path to node 2: (0, 2)
    ancestors-or-self mask:    node 0: [1, 0, 0]; node 1: [0, 1, 0]; node 2: [1, 0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

ROOT = -1  # the parent of a depth-1 node: the last committed token


@dataclass(frozen=True, slots=True)
class TokenTree:
    """A tree draft's shape (tokens live in the `Draft`).

    parents: per node, its parent node, or ROOT (-1); parents[i] < i.
    depths: per node, its depth (a child of the root has depth 1), derived.
    children: per node and for the root (index N), its children in increasing order, derived.
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        bad = [i for i, p in enumerate(parents) if not ROOT <= p < i]
        if bad:
            raise ValueError(
                f"node {bad[0]}'s parent must be -1 (the root) or an earlier node "
                f"(0..{bad[0] - 1}), got {parents[bad[0]]}; nodes go in topological order"
            )
        depths: list[int] = []
        kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
        for node, parent in enumerate(parents):
            depths.append(1 if parent == ROOT else depths[parent] + 1)
            kids[parent].append(node)  # ROOT (-1) indexes the last list: the root's children
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(k) for k in kids))

    @classmethod
    def chain(cls, length: int) -> TokenTree:
        """A chain of `length` nodes: node i's parent is i - 1."""
        return cls(tuple(range(-1, length - 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path (0 for an empty tree)."""
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to `node`, in order (depth 1 first)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return tuple(reversed(out))

    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: row i is True at i and at every ancestor of i (what node i attends)."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)  # [N, N]
        for node, parent in enumerate(self.parents):
            if parent != ROOT:
                mask[node] |= mask[parent]
        return mask
