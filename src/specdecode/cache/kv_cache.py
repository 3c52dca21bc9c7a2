"""Slot-indexed key/value storage: rows append at their own length; rollback moves a length.

Each batch row `b` owns slots `0 .. capacity-1` and a length: its slots `0 .. length-1` hold
keys/values that belong to the row. A forward pass writes where its `AttentionMetadata` says
(row b's new token t at slot `starts[b] + t`) and then sets each row's length to
`starts[b] + num_new[b]`. `truncate` moves lengths back in O(1): slots beyond a length are
never read and get overwritten. Token trees write their nodes at consecutive slots and keep
the accepted path with `compact`, which copies it once. The cache never decides how a pass
attends; the metadata does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.model.attention_metadata import AttentionMetadata


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
        self.lengths: list[int] = [0] * batch_size  # slots that belong to each row (host side)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def check(self, meta: AttentionMetadata) -> None:
        """Refuse a pass that does not continue every row at its length or does not fit."""
        if list(meta.starts) != self.lengths:
            raise ValueError(
                f"the pass starts rows at slots {list(meta.starts)} but the cache holds "
                f"{self.lengths} tokens per row; truncate the cache first"
            )
        if meta.span > self.capacity:
            raise ValueError(
                f"KV cache full: {max(meta.starts)} + {meta.width} tokens > capacity "
                f"{self.capacity}"
            )

    def write(
        self,
        layer: int,
        k: Tensor,  # [B, T, Hkv, D]
        v: Tensor,  # [B, T, Hkv, D]
        meta: AttentionMetadata,
        slots: Tensor | None,  # [B, T] from meta.write_slots(), None = one start for all rows
    ) -> tuple[Tensor, Tensor]:
        """Store one layer's keys/values of the pass; return the [B, Hkv, S, D] views a query
        may read (S = meta.span)."""
        if slots is None:
            s0 = meta.starts[0]
            self.k[layer, :, :, s0 : s0 + meta.width] = k.transpose(1, 2)
            self.v[layer, :, :, s0 : s0 + meta.width] = v.transpose(1, 2)
        else:
            rows = torch.arange(meta.batch_size, device=k.device)[:, None]  # [B, 1]
            self.k[layer, rows, :, slots] = k  # advanced indices first: [B, T, Hkv, D]
            self.v[layer, rows, :, slots] = v
        return self.k[layer, :, :, : meta.span], self.v[layer, :, :, : meta.span]

    def advance(self, meta: AttentionMetadata) -> None:
        """After a pass: every row holds its new tokens (padding excluded)."""
        self.lengths = list(meta.ends)

    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Roll rows back to `lengths` (one int for all rows, or one per row); O(1)."""
        new = [lengths] * self.batch_size if isinstance(lengths, int) else list(lengths)
        if len(new) != self.batch_size or any(
            n < 0 or n > cur for n, cur in zip(new, self.lengths, strict=True)
        ):
            raise ValueError(f"cannot truncate lengths {self.lengths} to {new}")
        self.lengths = new

    def compact(self, starts: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        """Keep, for each row, the new slots `kept[b]` of the last pass and drop the others.

        Row b's pass wrote its nodes at slots starts[b] + 0, 1, ...; `kept[b]` lists the node
        offsets to keep, increasing (a root-to-leaf path of a tree in topological order). They
        are copied to slots starts[b] + 0, 1, ... (once, every layer) and the row's length
        becomes starts[b] + len(kept[b]). A leading run already in place is not copied.
        Example: starts [10], kept [[0, 2, 5]] -> slot 12 -> 11, slot 15 -> 12, length 13.
        """
        if len(starts) != self.batch_size or len(kept) != self.batch_size:
            raise ValueError(f"compact needs starts and kept for each of {self.batch_size} rows")
        for row, (start, offsets) in enumerate(zip(starts, kept, strict=True)):
            offsets = list(offsets)
            end = start + len(offsets)
            if any(b <= a for a, b in itertools.pairwise(offsets)) or (
                offsets and (offsets[0] < 0 or start + offsets[-1] >= self.lengths[row])
            ):
                raise ValueError(
                    f"row {row}: kept offsets {offsets} must increase and lie within the "
                    f"row's {self.lengths[row] - start} new slots"
                )
            first = next((i for i, o in enumerate(offsets) if o != i), len(offsets))
            if first < len(offsets):
                src = torch.tensor(offsets[first:], device=self.k.device) + start
                dst = slice(start + first, end)
                self.k[:, row, :, dst] = self.k[:, row, :, src]  # the source is gathered first
                self.v[:, row, :, dst] = self.v[:, row, :, src]
            self.lengths[row] = end

    def load_prefix(self, source: KVCache, length: int, row: int = 0) -> None:
        """Make every row hold `source` row `row`'s first `length` slots (copied once, every
        layer), e.g. a grown cache taking over a smaller one, or copies of one prompt."""
        if length > min(self.capacity, source.lengths[row]):
            raise ValueError(
                f"cannot load {length} slots: the source row holds {source.lengths[row]}, "
                f"this cache {self.capacity}"
            )
        self.k[:, :, :, :length] = source.k[:, row : row + 1, :, :length]  # [L, B, Hkv, n, D]
        self.v[:, :, :, :length] = source.v[:, row : row + 1, :, :length]
        self.lengths = [length] * self.batch_size

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every batch row not in `rows` (finished sequences); copies the kept rows once."""
        index = torch.tensor(list(rows), device=self.k.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self.lengths = [self.lengths[r] for r in rows]
