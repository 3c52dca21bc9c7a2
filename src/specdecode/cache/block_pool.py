"""Fixed-size blocks of keys and values, handed to cache rows and taken back (a paged KV cache's
memory; vLLM's block pool).

A pool holds `num_blocks` blocks of `BLOCK_TOKENS` slots for every layer: keys and values
[L, blocks, Hkv, BLOCK_TOKENS, D]. Rows own blocks through their block tables (`KVCache`); a
block may be held by several rows at once (a prompt prefix they share) and is counted by
references. A block no row holds is free, or, when the prefix cache knows its tokens
(`cached`), idle: it keeps its keys and values for a later prompt that starts the same way
until the pool needs it (least recently released first) or the idle blocks pass
`max_idle`.

The pool grows on demand (by half, reallocating: amortised copies), never past `max_blocks`;
`allocate` refuses what it cannot give (`KVCacheFull`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

BLOCK_TOKENS = 16  # slots per block (vLLM's default block size)


class KVCacheFull(ValueError):
    """The pool has no free block left and may not grow."""


def blocks_for(slots: int) -> int:
    """Blocks that hold `slots` slots."""
    return -(-slots // BLOCK_TOKENS)


class BlockPool:
    """Blocks of keys and values for one model's layers (module docstring).

    k, v: [L, num_blocks, Hkv, BLOCK_TOKENS, D].
    cached: block -> its prefix-cache key, for blocks whose tokens the prefix cache knows
        (maintained by `PrefixCache`).
    max_idle: idle cached blocks kept at most (beyond, the least recently released is freed).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_blocks: int = 0,
        max_blocks: int | None = None,
    ) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"a pool of {max_blocks} blocks holds nothing")
        self.max_blocks = max_blocks
        num_blocks = num_blocks if max_blocks is None else min(num_blocks, max_blocks)
        shape = (num_layers, num_blocks, num_kv_heads, BLOCK_TOKENS, head_dim)
        # zeros: a batched attention reads (masked) slots no pass wrote; they must be finite
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low blocks first
        self.cached: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.max_idle = 0

    @property
    def num_blocks(self) -> int:
        """Blocks allocated in memory (held, idle or free)."""
        return len(self.refs)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by at least one row."""
        return self.num_blocks - len(self._free) - len(self.idle)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one row (each held once): free ones, then new ones (the pool
        grows), then idle ones (the least recently released first, forgotten by the prefix
        cache)."""
        if count > len(self._free):
            self._grow(count - len(self._free))
        while count > len(self._free) and self.idle:
            self._free.append(self._evict())
        if count > len(self._free):
            raise KVCacheFull(
                f"KV cache full: {count} more blocks of {BLOCK_TOKENS} tokens wanted, "
                f"{len(self._free)} free of {self.num_blocks} (at most {self.max_blocks})"
            )
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self.refs[block] = 1
        return blocks

    def hold(self, blocks: Iterable[int]) -> None:
        """One more reference to each of `blocks` (held or idle: an idle block is taken back)."""
        for block in blocks:
            if self.refs[block] == 0:
                if block not in self.idle:
                    raise ValueError(f"block {block} is free: it holds nothing to share")
                del self.idle[block]
            self.refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One reference less to each of `blocks`, in order; a block nobody holds becomes
        idle when cached (released later = evicted later), else free."""
        for block in blocks:
            if self.refs[block] < 1:
                raise ValueError(f"block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.cached:
                    self.idle[block] = None
                else:
                    self._free.append(block)
        while len(self.idle) > self.max_idle:
            self._free.append(self._evict())

    def forget(self, block: int) -> None:
        """The prefix cache drops `block`: an idle block becomes free."""
        self.cached.pop(block, None)
        if block in self.idle:
            del self.idle[block]
            self._free.append(block)

    def _evict(self) -> int:
        """Free the least recently released idle block; returns it."""
        block, _ = self.idle.popitem(last=False)
        del self.cached[block]
        return block

    def _grow(self, more: int) -> None:
        """Add at least `more` blocks (half the pool or more), within `max_blocks`."""
        old = self.num_blocks
        new = max(old + more, old * 3 // 2, 4)
        if self.max_blocks is not None:
            new = min(new, self.max_blocks)
        if new <= old:
            return
        layers, _, heads, size, dim = self.k.shape
        shape = (layers, new, heads, size, dim)
        for name in ("k", "v"):
            grown = torch.zeros(shape, dtype=self.k.dtype, device=self.k.device)
            grown[:, :old] = getattr(self, name)
            setattr(self, name, grown)
        self.refs.extend([0] * (new - old))
        self._free[:0] = range(new - 1, old - 1, -1)  # below the stack's top: old ones first
