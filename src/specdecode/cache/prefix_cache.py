"""Automatic prefix caching: the keys and values of token blocks seen before, so a prompt that
starts like an earlier sequence (a chat's next turn, a shared system prompt, an agent's loop)
prefills only what is new.

Sequences are cut into full blocks of `block_tokens` tokens. A block is known by its tokens
and every token before it: its key chains the previous block's key with its own tokens (vLLM's
block hash), and each entry keeps its tokens and parent, so a lookup compares them and a hash
collision can never serve another sequence's keys. Entries hold copies of the blocks' keys and
values ([2, layers, kv heads, block, head dim]), taken from a cache row after a prefill and
when a request leaves (its prompt and what it generated); a hit copies them into the new
request's row. The least recently used blocks go first when the cache passes `max_tokens`;
a sequence's blocks are touched deepest first, so its later blocks go before its earlier ones
(a block is reachable only through its parents).

What is not cached: the last prompt token's logits (a hit always leaves at least one prompt
token to prefill, the one whose logits draw the first token) and the target's hidden states
(a drafter that reads them, EAGLE-3 or an exit head, gets no hits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache

BLOCK_TOKENS = 16  # tokens per cached block (vLLM's default block size)


@dataclass(frozen=True, slots=True)
class _Block:
    parent: int | None  # the previous block's key (None: the sequence's first block)
    tokens: tuple[int, ...]
    kv: Tensor  # [2, L, Hkv, block_tokens, D]


class PrefixCache:
    """Cached blocks of keys and values for one model, at most `max_tokens` tokens of them.

    queried_tokens / hit_tokens count the prompt tokens looked up and those found (vLLM's
    prefix-cache metrics)."""

    def __init__(self, max_tokens: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if max_tokens < block_tokens:
            raise ValueError(f"a prefix cache of {max_tokens} tokens holds no block")
        self.max_blocks = max_tokens // block_tokens
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Tokens cached."""
        return len(self._blocks) * self.block_tokens

    def _keys(self, token_ids: Sequence[int], length: int) -> list[tuple[int, int | None]]:
        """(key, parent key) of each full block among the first `length` tokens."""
        keys: list[tuple[int, int | None]] = []
        parent = None
        size = self.block_tokens
        for start in range(0, length - size + 1, size):
            key = hash((parent, tuple(token_ids[start : start + size])))
            keys.append((key, parent))
            parent = key
        return keys

    def load(self, token_ids: Sequence[int], cache: KVCache) -> int:
        """Copy the longest cached run of `token_ids`' leading blocks into `cache`'s row 0
        (a one-row view, empty) and set its length; returns the tokens loaded: a multiple of
        the block size, and fewer than len(token_ids)."""
        self.queried_tokens += len(token_ids)
        keys = self._keys(token_ids, len(token_ids) - 1)
        found: list[_Block] = []
        for index, (key, parent) in enumerate(keys):
            block = self._blocks.get(key)
            start = index * self.block_tokens
            tokens = tuple(token_ids[start : start + self.block_tokens])
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            found.append(block)
        self._touch([key for key, _ in keys[: len(found)]])
        if not found:
            return 0
        length = len(found) * self.block_tokens
        kv = torch.cat([b.kv for b in found], dim=3)  # [2, L, Hkv, length, D]
        cache.k[:, 0, :, :length] = kv[0]
        cache.v[:, 0, :, :length] = kv[1]
        cache.set_length(0, length)
        self.hit_tokens += length
        return length

    def store(self, token_ids: Sequence[int], cache: KVCache, row: int) -> None:
        """Keep the full blocks of `token_ids` that `cache`'s row `row` holds (its first
        `cache.lengths[row]` slots, which belong to those tokens) and are not cached yet."""
        length = min(len(token_ids), cache.lengths[row])
        size = self.block_tokens
        keys = self._keys(token_ids, length)
        for index, (key, parent) in enumerate(keys):
            if key not in self._blocks:
                slots = slice(index * size, (index + 1) * size)
                kv = torch.stack([cache.k[:, row, :, slots], cache.v[:, row, :, slots]])
                self._blocks[key] = _Block(parent, tuple(token_ids[slots]), kv)
        self._touch([key for key, _ in keys])
        while len(self._blocks) > self.max_blocks:  # the least recently used first
            self._blocks.popitem(last=False)

    def _touch(self, chain: list[int]) -> None:
        """Mark a sequence's blocks (root first in `chain`) used now, the deepest first, so
        eviction takes a sequence's later blocks before its earlier ones."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    def clear(self) -> None:
        """Forget every block (the counters stay)."""
        self._blocks.clear()
