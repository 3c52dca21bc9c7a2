"""A suffix trie of bounded depth with occurrence counts: what suffix decoding drafts from.

Every suffix of every sequence added is inserted down to `max_depth` tokens; a node's `count` is
how many times the token path from the root to it occurs in the sequences (so a child's count
over the sum of its siblings' is the empirical probability of that next token). Worked example,
max_depth 3, one sequence [5, 6, 5, 6]:

    suffixes cut to 3 tokens: [5, 6, 5], [6, 5, 6], [5, 6], [6]
    root -5 (2) -6 (2) -5 (1)            paths and counts: "5" occurs twice, "5 6" twice,
         -6 (2) -5 (1) -6 (1)            "5 6 5" once, "6" twice, "6 5" once, "6 5 6" once
    after the suffix "5 6": children of "5 6" = {5: 1} -> draft 5 with probability 1

Because every suffix is inserted, the trie is suffix-closed: if a path of length L exists, so
does its suffix of length L - 1. So the context's suffixes that match form one run of lengths
1..M, and a `Cursor` (the nodes of those suffixes) follows a growing context in O(max_depth)
per token: the new matches are the old ones (and the root) extended by the new token, up to the
first that does not extend.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from specdecode.tree.token_tree import ROOT


class Node:
    """One trie node: the occurrences of its path, and its children by next token."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A draft read off the trie after a matched suffix.

    tokens: the draft's tokens (a chain, or a tree's nodes in topological order).
    parents: per token, its parent's index in `tokens`, or ROOT (-1).
    score: the sum of the tokens' estimated probabilities (each the product of the
        frequency ratios along its path): the expected number of accepted tokens.
    match_length: the length of the matched suffix the draft continues.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    score: float
    match_length: int


EMPTY = Candidate((), (), 0.0, 0)


class SuffixTree:
    """A bounded-depth suffix trie over token sequences (see the module docstring).

    Args:
        max_depth: the longest path kept; a matched suffix plus its draft never exceed it.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 0
        self.version = 0  # bumped whenever a sequence is added or removed (cursors re-match)

    def add(self, tokens: Sequence[int]) -> None:
        """Insert every suffix of `tokens` (cut to max_depth tokens)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                node = self._child(node, token)
                node.count += 1
        self.version += 1

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)` for a sequence added before: decrement its paths' counts and drop
        the nodes no sequence reaches any more."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    del node.children[token]
                    break
                node = child
        self.version += 1

    def extend(self, opened: list[Node], token: int) -> list[Node]:
        """Append `token` to a sequence being added incrementally: `opened` are the nodes of its
        suffixes of lengths 1.. (at most max_depth - 1, shortest first; [] for a new
        sequence). Counts the new suffixes and returns the new `opened`."""
        grown = []
        for node in (self.root, *opened):
            child = self._child(node, token)
            child.count += 1
            grown.append(child)
        return grown[: self.max_depth - 1]

    def _child(self, node: Node, token: int) -> Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = Node()
            self.num_nodes += 1
        return child


def _size(node: Node) -> int:
    """The nodes of the subtree under and including `node`."""
    return 1 + sum(_size(child) for child in node.children.values())


class Cursor:
    """The trie nodes that the suffixes of a growing context match, shortest first.

    Follows one context through a trie that may change (`SuffixTree.version`): after a change
    it re-matches the context's last max_depth - 1 tokens from the root.
    """

    __slots__ = ("nodes", "version")

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.version = -1

    def follow(self, tree: SuffixTree, context: Sequence[int], new: int) -> None:
        """Bring the cursor to the end of `context`, whose last `new` tokens it has not seen."""
        if self.version != tree.version:
            self.nodes, self.version = match(tree, context), tree.version
            return
        for token in context[len(context) - new :]:
            grown = []
            for node in (tree.root, *self.nodes):
                child = node.children.get(token)
                if child is None:
                    break
                grown.append(child)
            self.nodes = grown[: tree.max_depth - 1]


def match(tree: SuffixTree, context: Sequence[int]) -> list[Node]:
    """The nodes of the context's suffixes found in the trie, lengths 1.. (shortest first, at
    most max_depth - 1), walked from the root."""
    nodes: list[Node] = []
    for length in range(1, min(tree.max_depth - 1, len(context)) + 1):
        node: Node | None = tree.root
        for token in context[len(context) - length :]:
            node = node.children.get(token)
            if node is None:
                return nodes
        nodes.append(node)
    return nodes


def best_candidate(
    matches: Sequence[Node],
    max_tokens: int,
    spec_factor: float,
    min_prob: float,
    width: int,
    banned: Collection[int],
) -> Candidate:
    """The highest-scoring draft after any of the matched suffixes (`matches[m - 1]` matches
    the suffix of length m), longest match first: each draft holds at most
    min(max_tokens, spec_factor * m) tokens; ties keep the longer match. Stops as soon as no
    shorter match could score higher (a draft of n tokens scores at most n)."""
    best = EMPTY
    for length in range(len(matches), 0, -1):
        limit = min(max_tokens, int(spec_factor * length))
        if limit <= best.score:
            break
        node = matches[length - 1]
        if node.children:
            found = grow(node, limit, min_prob, width, banned, length)
            if found.score > best.score:
                best = found
    return best


def grow(
    node: Node, limit: int, min_prob: float, width: int, banned: Collection[int], length: int
) -> Candidate:
    """The draft below `node`: best-first by estimated probability, at most `limit` tokens
    and `width` children per node, each token's probability >= `min_prob`, no token of
    `banned` (nor anything below one). width 1 is a chain: the most frequent child each time.

    Example: children of `node` {7: 3, 8: 1}, of 7 {9: 2}: probabilities 7 -> 0.75,
    7 9 -> 0.75, 8 -> 0.25; limit 3, width 2 gives tokens (7, 9, 8), parents (-1, 0, -1).
    """
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    taken = [0]  # children taken per draft token; the last entry is the root's
    heap: list[tuple[float, int, int, int, Node]] = []  # (-prob, tie, parent, token, node)
    tie = 0

    def push(parent: int, prob: float, below: Node) -> None:
        nonlocal tie
        total = sum(child.count for child in below.children.values())
        for token, child in below.children.items():
            if token not in banned:
                p = prob * child.count / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tie, parent, token, child))
                    tie += 1

    push(ROOT, 1.0, node)
    while heap and len(tokens) < limit:
        neg, _, parent, token, child = heapq.heappop(heap)
        if taken[parent] == width:
            continue
        taken[parent] += 1
        tokens.append(token)
        parents.append(parent)
        taken.insert(-1, 0)  # the new token's slot, before the root's
        score -= neg
        push(len(tokens) - 1, -neg, child)
    return Candidate(tuple(tokens), tuple(parents), score, length)
