"""Automatic prefix caching: blocks of keys and values seen before are shared, so a prompt that
starts like an earlier sequence (a chat's next turn, a shared system prompt, an agent's loop,
the other choices of an `n > 1` request) prefills only what is new.

Sequences are cut into full blocks of `BLOCK_TOKENS` tokens. A block is known by its tokens
and every token before it: its key chains the previous block's key with its own tokens (vLLM's
block hash), and each entry keeps its tokens and parent, so a lookup compares them and a hash
collision can never serve another sequence's keys. The cache holds no copies: an entry names
a block of the running cache's `BlockPool`. A row's full blocks are entered after each prefill
(chunk) and when its request leaves (its prompt and what it generated); a hit puts the same
blocks in the new request's block table (read-only: a row only writes past its length). A
block no row holds stays idle in the pool until the pool needs it or more than `max_tokens`
tokens are idle, the least recently released first; a row releases its blocks last first, so
a sequence's later blocks go before its earlier ones (a block is reachable only through its
parents).

What is not cached: the last prompt token's logits (a hit always leaves at least one prompt
token to prefill, the one whose logits draw the first token) and the target's hidden states
(a drafter that reads them, EAGLE-3 or an exit head, gets no hits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.cache.block_pool import BLOCK_TOKENS, BlockPool
from specdecode.cache.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class _Entry:
    block: int  # the pool block holding its keys and values
    parent: int | None  # the previous block's key (None: the sequence's first block)
    tokens: tuple[int, ...]


class PrefixCache:
    """Known blocks of one cache's pool; at most `max_tokens` tokens of them idle.

    queried_tokens / hit_tokens count the prompt tokens looked up and those found (vLLM's
    prefix-cache metrics)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < BLOCK_TOKENS:
            raise ValueError(f"a prefix cache of {max_tokens} tokens holds no block")
        self.max_blocks = max_tokens // BLOCK_TOKENS
        self._entries: dict[int, _Entry] = {}
        self._pool: BlockPool | None = None
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose blocks are known (held by rows or idle)."""
        return 0 if self._pool is None else len(self._pool.cached) * BLOCK_TOKENS

    def _bind(self, pool: BlockPool) -> BlockPool:
        """Serve `pool` (a new pool: the entries of the old one are dropped)."""
        if pool is not self._pool:
            self._entries.clear()
            self._pool = pool
            pool.max_idle = self.max_blocks
        return pool

    def _keys(self, token_ids: Sequence[int], length: int) -> list[tuple[int, int | None]]:
        """(key, parent key) of each full block among the first `length` tokens."""
        keys: list[tuple[int, int | None]] = []
        parent = None
        for start in range(0, length - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = hash((parent, tuple(token_ids[start : start + BLOCK_TOKENS])))
            keys.append((key, parent))
            parent = key
        return keys

    def _find(
        self, pool: BlockPool, key: int, parent: int | None, tokens: tuple[int, ...]
    ) -> _Entry | None:
        """The live entry for this block, or None (an entry whose block the pool has since
        evicted is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if pool.cached.get(entry.block) != key:
            del self._entries[key]
            return None
        return entry if entry.parent == parent and entry.tokens == tokens else None

    def load(self, token_ids: Sequence[int], cache: KVCache) -> int:
        """Give `cache`'s row 0 (a one-row view, empty) the longest cached run of
        `token_ids`' leading blocks (shared, not copied) and set its length; returns the
        tokens loaded: a multiple of the block size, and fewer than len(token_ids)."""
        pool = self._bind(cache.pool)
        if cache.lengths[0] or cache.tables[0]:
            raise ValueError("a prefix is loaded into an empty row")
        self.queried_tokens += len(token_ids)
        blocks = []
        for index, (key, parent) in enumerate(self._keys(token_ids, len(token_ids) - 1)):
            start = index * BLOCK_TOKENS
            tokens = tuple(token_ids[start : start + BLOCK_TOKENS])
            entry = self._find(pool, key, parent, tokens)
            if entry is None:
                break
            blocks.append(entry.block)
        if not blocks:
            return 0
        pool.hold(blocks)
        cache.tables[0].extend(blocks)
        length = len(blocks) * BLOCK_TOKENS
        cache.set_length(0, length)
        self.hit_tokens += length
        return length

    def store(self, token_ids: Sequence[int], cache: KVCache, row: int) -> None:
        """Enter the full blocks of `token_ids` that `cache`'s row `row` holds (its first
        `cache.lengths[row]` slots, which belong to those tokens) and are not known yet."""
        pool = self._bind(cache.pool)
        length = min(len(token_ids), cache.lengths[row])
        table = cache.tables[row]
        for index, (key, parent) in enumerate(self._keys(token_ids, length)):
            start = index * BLOCK_TOKENS
            tokens = tuple(token_ids[start : start + BLOCK_TOKENS])
            block = table[index]
            if self._find(pool, key, parent, tokens) is None and block not in pool.cached:
                pool.cached[block] = key
                self._entries[key] = _Entry(block, parent, tokens)

    def clear(self) -> None:
        """Forget every block (the counters stay); idle blocks become free."""
        if self._pool is not None:
            for block in list(self._pool.cached):
                self._pool.forget(block)
        self._entries.clear()
