"""Slot-indexed key/value cache: rows append at their own length; rollback moves a length.

Each batch row `b` owns slots `0 .. capacity-1`. A forward pass over `T` new tokens writes them
at slots `lengths[b] .. lengths[b] + T - 1` and advances `lengths[b]` by `T`; `truncate` moves a
length back in O(1) (stale slots beyond a length are never attended and get overwritten). For
chain decoding slot == position; tree drafts (later) write their nodes at consecutive slots with
an explicit mask and keep the accepted path with `compact`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class KVCache:
    """Key/value buffers for every layer of one batch of sequences."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.capacity = capacity
        self.lengths: list[int] = [0] * batch_size  # committed slots per row (host side)
        self._start: list[int] = list(self.lengths)  # lengths at the start of the current pass
        self._num_new = 0
        self._slots: Tensor | None = None  # [B, T] write slots of this pass; None = one offset

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def starts(self) -> list[int]:
        """Each row's committed length when the current pass began (its first new slot)."""
        return self._start

    def begin(self, num_new: int, mask: Tensor | None = None) -> Tensor | None:
        """Start a forward pass over `num_new` tokens per row; return the attention mask.

        Query t of row b may attend slot s iff `s < start_b` (the committed prefix) or the new
        token `r = s - start_b` satisfies `mask[b, t, r]` (default: causal, `r <= t`).
        Example: start = [2], num_new = 2 -> slots 0..3, query 0 sees 0,1,2 and query 1 sees 0..3.
        Returns None when every query may see every slot it reads (one row, one new token).

        mask: [B, T, T] bool among the new tokens (trees), or None for causal.
        Returns: [B, 1, T, S] bool, S = max(start) + T, or None.
        """
        if max(self.lengths) + num_new > self.capacity:
            raise ValueError(
                f"KV cache full: {max(self.lengths)} + {num_new} tokens > capacity {self.capacity}"
            )
        self._start, self._num_new = list(self.lengths), num_new
        device = self.k.device
        uniform = len(set(self._start)) == 1
        self._slots = (
            None
            if uniform
            else torch.tensor(self._start, device=device)[:, None]
            + torch.arange(num_new, device=device)
        )
        if mask is None and num_new == 1 and uniform:
            return None
        span = max(self._start) + num_new
        start = torch.tensor(self._start, device=device)  # [B]
        rel = torch.arange(span, device=device)[None, None, :] - start[:, None, None]  # [B,1,S]
        query = torch.arange(num_new, device=device)[None, :, None]  # [1, T, 1]
        if mask is None:
            allowed = rel <= query  # [B, T, S]
        else:
            idx = rel.clamp(0, num_new - 1).expand(-1, num_new, -1)  # [B, T, S]
            allowed = (rel < 0) | ((rel < num_new) & mask.gather(2, idx))
        return allowed[:, None]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this pass's keys/values for `layer`; return all keys/values a query may read.

        k, v: [B, T, Hkv, D]. Returns two [B, Hkv, S, D] views, S = max(start) + T.
        """
        starts, num_new = self._start, self._num_new
        if self._slots is None:  # every row starts at the same slot
            s0 = starts[0]
            self.k[layer, :, :, s0 : s0 + num_new] = k.transpose(1, 2)
            self.v[layer, :, :, s0 : s0 + num_new] = v.transpose(1, 2)
        else:
            rows = torch.arange(len(starts), device=k.device)[:, None]  # [B, 1]
            self.k[layer, rows, :, self._slots] = k  # advanced indices first: [B, T, Hkv, D]
            self.v[layer, rows, :, self._slots] = v
        span = max(starts) + num_new
        return self.k[layer, :, :, :span], self.v[layer, :, :, :span]

    def end(self) -> None:
        """Finish the pass: every row's length advances by the number of new tokens."""
        self.lengths = [s + self._num_new for s in self._start]

    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Roll rows back to `lengths` (one int for all rows, or one per row); O(1)."""
        new = [lengths] * self.batch_size if isinstance(lengths, int) else list(lengths)
        if len(new) != self.batch_size or any(
            n < 0 or n > cur for n, cur in zip(new, self.lengths, strict=True)
        ):
            raise ValueError(f"cannot truncate lengths {self.lengths} to {new}")
        self.lengths = new

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every batch row not in `rows` (finished sequences); copies the kept rows once."""
        index = torch.tensor(list(rows), device=self.k.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self.lengths = [self.lengths[r] for r in rows]
