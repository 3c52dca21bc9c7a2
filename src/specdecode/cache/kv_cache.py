"""Slot-indexed key/value storage: rows append at their own length; rollback moves a length.

Each batch row `b` owns slots `0 .. capacity-1` and a length: its slots `0 .. length-1` hold
keys/values that belong to the row. A forward pass writes where its `AttentionMetadata` says
(row b's new token t at slot `starts[b] + t`) and then sets each row's length to
`starts[b] + num_new[b]`. `truncate` moves lengths back in O(1): slots beyond a length are
never read and get overwritten. Token trees write their nodes at consecutive slots and keep
the accepted path with `compact`, which copies it once. The cache never decides how a pass
attends; the metadata does.

Rows come and go (continuous batching): the buffers hold a pool of allocated rows, the first
`batch_size` of them active. `add_rows` activates rows at the end (growing the pool or the
capacity, amortised, when it must), `row` is a one-row cache that writes into an active row in
place (a request's prefill runs there alone), `head` the same over the first rows (the rows
that decode while later ones still prefill), and `keep_rows` moves the kept rows down over
the dropped ones (copying only rows that move, only their filled slots).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata


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
        self._k_pool = torch.zeros(shape, dtype=dtype, device=device)  # [L, R, Hkv, S, D]
        self._v_pool = torch.zeros(shape, dtype=dtype, device=device)  # [L, R, Hkv, S, D]
        self.lengths: list[int] = [0] * batch_size  # slots that belong to each row (host side)
        self._activate()

    def _activate(self) -> None:
        """Point `k` / `v` at the active rows (the first `batch_size` of the pool)."""
        self.k = self._k_pool[:, : self.batch_size]  # [L, B, Hkv, S, D]
        self.v = self._v_pool[:, : self.batch_size]  # [L, B, Hkv, S, D]

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Slots per row."""
        return self._k_pool.shape[3]

    @property
    def pool_rows(self) -> int:
        """Rows allocated (active or free)."""
        return self._k_pool.shape[1]

    def add_rows(self, count: int, capacity: int, max_slots: int | None = None) -> list[int]:
        """Activate `count` empty rows after the active ones and give every active row room
        for at least `capacity` slots; returns the new rows' indices. The pool grows only when
        it must, and then with room to spare (twice the rows, 1.5 times the slots: amortised
        copies), but never past `max_slots` slots in all (rows x slots) when given; active
        rows keep their data."""
        rows, slots = self.pool_rows, self.capacity
        need_rows = self.batch_size + count
        if need_rows > rows or capacity > slots:
            new_rows = max(need_rows, 2 * rows) if need_rows > rows else rows
            new_slots = max(capacity, slots * 3 // 2) if capacity > slots else slots
            if max_slots is not None:
                new_slots = max(capacity, min(new_slots, max_slots // need_rows))
                new_rows = max(need_rows, min(new_rows, max_slots // new_slots))
            self._grow(new_rows, new_slots)
        first = self.batch_size
        self.lengths.extend([0] * count)
        self._activate()
        return list(range(first, first + count))

    def _grow(self, rows: int, slots: int) -> None:
        """Reallocate the pool with `rows` rows of `slots` slots; active rows keep their slots."""
        old_k, old_v = self._k_pool, self._v_pool
        layers, _, heads, _, dim = old_k.shape
        shape = (layers, rows, heads, slots, dim)
        self._k_pool = torch.zeros(shape, dtype=old_k.dtype, device=old_k.device)
        self._v_pool = torch.zeros(shape, dtype=old_v.dtype, device=old_v.device)
        used = max(self.lengths, default=0)
        active = self.batch_size
        self._k_pool[:, :active, :, :used] = old_k[:, :active, :, :used]
        self._v_pool[:, :active, :, :used] = old_v[:, :active, :, :used]

    def row(self, index: int) -> KVCache:
        """A one-row cache over active row `index`'s storage (writes land in this cache, no
        copy), starting empty; set this cache's length from it after its passes
        (`set_length`)."""
        if not 0 <= index < self.batch_size:
            raise ValueError(f"row {index} is not active (rows 0..{self.batch_size - 1})")
        view = KVCache.__new__(KVCache)
        view._k_pool = self._k_pool[:, index : index + 1]
        view._v_pool = self._v_pool[:, index : index + 1]
        view.lengths = [0]
        view._activate()
        return view

    def head(self, count: int) -> KVCache:
        """A cache over the first `count` active rows' storage (writes land in place) and their
        lengths; give its lengths back with `take_lengths` after its passes."""
        if not 0 < count <= self.batch_size:
            raise ValueError(f"head of {count} rows: the cache has {self.batch_size} active")
        view = KVCache.__new__(KVCache)
        view._k_pool = self._k_pool[:, :count]
        view._v_pool = self._v_pool[:, :count]
        view.lengths = self.lengths[:count]
        view._activate()
        return view

    def take_lengths(self, head: KVCache) -> None:
        """The lengths of a `head` view's rows, after its passes."""
        self.lengths[: head.batch_size] = head.lengths

    def set_length(self, index: int, length: int) -> None:
        """Row `index` holds `length` slots (written through a `row` view)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} is outside 0..{self.capacity}")
        self.lengths[index] = length

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
        """Keep the active rows `rows` (increasing), as rows 0, 1, ...; drop the others
        (finished sequences). A kept row that moves is copied once (its filled slots); the
        dropped rows return to the pool."""
        rows = list(rows)
        if any(b <= a for a, b in itertools.pairwise(rows)) or (
            rows and not 0 <= rows[0] <= rows[-1] < self.batch_size
        ):
            raise ValueError(f"keep_rows needs increasing active rows, got {rows}")
        for dst, src in enumerate(rows):
            if dst != src:
                n = self.lengths[src]
                self._k_pool[:, dst, :, :n] = self._k_pool[:, src, :, :n]
                self._v_pool[:, dst, :, :n] = self._v_pool[:, src, :, :n]
        self.lengths = [self.lengths[r] for r in rows]
        self._activate()
