"""A paged key/value cache: each row's slots live in fixed-size blocks of a `BlockPool`, found
through the row's block table; rollback moves a length and returns whole blocks.

Each batch row `b` holds a length and a block table: its slot s is slot s % BLOCK_TOKENS of
block table[b][s // BLOCK_TOKENS], and its slots 0 .. length-1 hold keys/values that belong
to the row. Memory follows the tokens actually held (whole blocks: at most one partly filled
block per row), not rows x the longest request. A forward pass first `prepare`s the cache
(blocks for every slot it writes, padding included), writes where its `AttentionMetadata` says
(row b's new token t at slot `starts[b] + t`) and then sets each row's length to
`starts[b] + num_new[b]` (`advance`), returning blocks past it. `truncate` moves lengths back
the same way. Token trees write their nodes at consecutive slots and keep the accepted path
with `compact`, which copies it once. The cache never decides how a pass attends; the
metadata does.

Rows come and go (continuous batching): `add_rows` appends empty rows, `keep_rows` keeps some
(the others' blocks go back to the pool: no copy), `row` is a one-row cache over an active
row's blocks (from length 0: a prefix cache's hit is loaded there), `rows` one over
consecutive rows and their lengths (the rows that decode while later ones still prefill; the
prompts prefilled together) and `select` one over any rows, in any order (the sequences a
block drafter drafts for). Writes through a view land in the rows' blocks. Several rows
may hold one block (a shared prompt prefix, `PrefixCache`): such blocks are full and never
written again, since a row only writes past its length.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.block_pool import BLOCK_TOKENS, BlockPool, blocks_for


@dataclass(frozen=True, slots=True)
class _Pass:
    """Where one pass writes: its metadata and the block table it runs with."""

    meta: AttentionMetadata
    table: Tensor  # [B, max_blocks] int64 on the pool's device


@dataclass(frozen=True, slots=True)
class _Table:
    """The last block table built: the rows' blocks it was built from, and the tensor."""

    rows: list[list[int]]  # a copy of each row's blocks, padded to the table's width
    tensor: Tensor  # [B, max_blocks] int64 on the pool's device


class KVCache:
    """Keys and values of every layer for one batch of sequences, in a pool's blocks."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_tokens: int | None = None,
    ) -> None:
        """`batch_size` empty rows; the pool starts with blocks for `capacity` slots per row
        and grows as rows fill, up to `max_tokens` slots in all (None: no limit)."""
        max_blocks = None if max_tokens is None else max(1, max_tokens // BLOCK_TOKENS)
        self.pool = BlockPool(
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            batch_size * blocks_for(capacity),
            max_blocks,
        )
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]  # blocks of each row
        self.lengths: list[int] = [0] * batch_size  # slots that belong to each row
        self._pass: _Pass | None = None
        self._table: _Table | None = None
        self._where: tuple[Tensor, Tensor] | None = None

    @classmethod
    def _view(cls, pool: BlockPool, tables: list[list[int]], lengths: list[int]) -> KVCache:
        """A cache over `pool` whose rows are `tables` (the same lists: block changes are
        shared) with their own `lengths`."""
        view = cls.__new__(cls)
        view.pool, view.tables, view.lengths = pool, tables, lengths
        view._pass, view._table, view._where = None, None, None
        return view

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def k(self) -> Tensor:
        """Every layer's key blocks [L, blocks, Hkv, BLOCK_TOKENS, D] (row b's slot s is in
        block tables[b][s // BLOCK_TOKENS])."""
        return self.pool.k

    @property
    def v(self) -> Tensor:
        """Every layer's value blocks, like `k`."""
        return self.pool.v

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def num_blocks(self) -> int:
        """Blocks the rows hold (a block shared by rows counts once per row)."""
        return sum(len(t) for t in self.tables)

    @property
    def block_table(self) -> Tensor:
        """[B, max_blocks] int64: the current pass's block table (after `prepare`)."""
        if self._pass is None:
            raise ValueError("no pass is prepared: call prepare(meta) first")
        return self._pass.table

    def add_rows(self, count: int) -> list[int]:
        """Append `count` empty rows; returns their indices."""
        first = self.batch_size
        self.tables.extend([] for _ in range(count))
        self.lengths.extend([0] * count)
        return list(range(first, first + count))

    def row(self, index: int) -> KVCache:
        """A one-row cache over active row `index`'s blocks (writes land in the row), starting
        at length 0; set this cache's length from it after its passes (`set_length`)."""
        if not 0 <= index < self.batch_size:
            raise ValueError(f"row {index} is not active (rows 0..{self.batch_size - 1})")
        return KVCache._view(self.pool, [self.tables[index]], [0])

    def rows(self, first: int, count: int) -> KVCache:
        """A cache over the active rows first .. first + count - 1 (their blocks: writes land
        in place) and their lengths; give its lengths back with `take_lengths` after its
        passes."""
        if first < 0 or count < 1 or first + count > self.batch_size:
            raise ValueError(
                f"rows {first}..{first + count - 1}: the cache has {self.batch_size} active"
            )
        return self.select(range(first, first + count))

    def select(self, rows: Sequence[int]) -> KVCache:
        """A cache over the active rows `rows`, in that order (their blocks: writes land in
        place), and their lengths; after its passes give each row its view's length with
        `set_length`."""
        if not rows or any(not 0 <= r < self.batch_size for r in rows):
            raise ValueError(f"rows {list(rows)}: the cache has {self.batch_size} active")
        tables = [self.tables[r] for r in rows]
        return KVCache._view(self.pool, tables, [self.lengths[r] for r in rows])

    def take_lengths(self, view: KVCache, first: int = 0) -> None:
        """The lengths of a `rows(first, ...)` view's rows, after its passes."""
        self.lengths[first : first + view.batch_size] = view.lengths

    def set_length(self, index: int, length: int) -> None:
        """Row `index` holds `length` slots (written through a `row` view); blocks past them
        go back to the pool."""
        held = len(self.tables[index]) * BLOCK_TOKENS
        if not 0 <= length <= held:
            raise ValueError(f"length {length} is outside 0..{held} (the row's blocks)")
        self.lengths[index] = length
        self._trim(index)

    def _trim(self, index: int) -> None:
        """Return row `index`'s blocks past its length to the pool (the last first)."""
        table = self.tables[index]
        keep = blocks_for(self.lengths[index])
        if len(table) > keep:
            self.pool.release(reversed(table[keep:]))
            del table[keep:]

    def prepare(self, meta: AttentionMetadata) -> None:
        """Before a pass: refuse one that does not continue every row at its length, give
        every row blocks for the slots the pass writes (padding included) and build its block
        table (`KVCacheFull` when the pool cannot give them: nothing changes then)."""
        if list(meta.starts) != self.lengths:
            raise ValueError(
                f"the pass starts rows at slots {list(meta.starts)} but the cache holds "
                f"{self.lengths} tokens per row; truncate the cache first"
            )
        need = [
            blocks_for(start + meta.width) - len(table)
            for start, table in zip(meta.starts, self.tables, strict=True)
        ]
        more = sum(n for n in need if n > 0)
        if more:
            blocks = iter(self.pool.allocate(more))
            for table, n in zip(self.tables, need, strict=True):
                table.extend(itertools.islice(blocks, max(n, 0)))
        width = blocks_for(meta.span)
        rows = [t + [0] * (width - len(t)) for t in self.tables]  # padding: never read
        if self._table is None or self._table.rows != rows:  # decode steps mostly reuse it
            table = torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, max_blocks]
            self._table = _Table(rows, table)
        self._pass = _Pass(meta, self._table.tensor)
        self._where = None

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store one layer's keys/values ([B, T, Hkv, D]) of the prepared pass (the native
        decoder layer writes through `block_table` itself; this is the torch route)."""
        if self._pass is None:
            raise ValueError("no pass is prepared: call prepare(meta) first")
        if self._where is None:  # the block and the slot within it of each new token
            meta, table = self._pass.meta, self._pass.table
            offsets = torch.arange(meta.width, device=self.device)  # [T]
            slots = torch.tensor(meta.starts, device=self.device)[:, None] + offsets  # [B, T]
            self._where = table.gather(1, slots // BLOCK_TOKENS), slots % BLOCK_TOKENS
        blocks, within = self._where
        self.pool.k[layer, blocks, :, within] = k  # advanced indices first: [B, T, Hkv, D]
        self.pool.v[layer, blocks, :, within] = v

    def read(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The [B, Hkv, S, D] keys and values the prepared pass may read (S = meta.span) for
        a batched attention, after `write`: `k` and `v` themselves ([B, T, Hkv, D]) when every
        row starts empty, else gathered from the blocks (one copy)."""
        table = self.block_table
        meta = self._pass.meta
        if meta.starts_empty:
            return k.transpose(1, 2), v.transpose(1, 2)
        batch, width = table.shape
        out = []
        for pool in (self.pool.k, self.pool.v):
            blocks = pool[layer][table]  # [B, max_blocks, Hkv, BLOCK_TOKENS, D]
            heads, dim = blocks.shape[2], blocks.shape[4]
            flat = blocks.transpose(1, 2).reshape(batch, heads, width * BLOCK_TOKENS, dim)
            out.append(flat[:, :, : meta.span])
        return out[0], out[1]

    def advance(self, meta: AttentionMetadata) -> None:
        """After a pass: every row holds its new tokens (padding excluded); blocks that hold
        only padding go back to the pool."""
        self.lengths = list(meta.ends)
        for row in range(self.batch_size):
            self._trim(row)
        self._pass, self._where = None, None

    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Roll rows back to `lengths` (one int for all rows, or one per row)."""
        new = [lengths] * self.batch_size if isinstance(lengths, int) else list(lengths)
        if len(new) != self.batch_size or any(
            n < 0 or n > cur for n, cur in zip(new, self.lengths, strict=True)
        ):
            raise ValueError(f"cannot truncate lengths {self.lengths} to {new}")
        self.lengths[:] = new
        for row in range(self.batch_size):
            self._trim(row)

    def _locate(self, row: int, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(blocks, offsets within them) of row `row`'s `slots`, as index tensors."""
        table = self.tables[row]
        device = self.device
        blocks = torch.tensor([table[s // BLOCK_TOKENS] for s in slots], device=device)
        return blocks, torch.tensor([s % BLOCK_TOKENS for s in slots], device=device)

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
                src = self._locate(row, [start + o for o in offsets[first:]])
                dst = self._locate(row, range(start + first, end))
                for pool in (self.pool.k, self.pool.v):
                    # the source is gathered first: [n, L, Hkv, D]
                    pool[:, dst[0], :, dst[1]] = pool[:, src[0], :, src[1]]
            self.lengths[row] = end
            self._trim(row)

    def load_prefix(self, source: KVCache, length: int, row: int = 0) -> None:
        """Make every row hold `source` row `row`'s first `length` slots (copied once, every
        layer), e.g. copies of one prompt."""
        if length > source.lengths[row]:
            raise ValueError(
                f"cannot load {length} slots: the source row holds {source.lengths[row]}"
            )
        count = blocks_for(length)
        src = torch.tensor(source.tables[row][:count], device=self.device)
        for index in range(self.batch_size):
            self.lengths[index] = 0
            self._trim(index)
            self.tables[index].extend(self.pool.allocate(count))
            dst = torch.tensor(self.tables[index], device=self.device)
            self.pool.k[:, dst] = source.pool.k[:, src]  # [L, count, Hkv, BLOCK_TOKENS, D]
            self.pool.v[:, dst] = source.pool.v[:, src]
            self.lengths[index] = length

    def gather(self, row: int) -> tuple[Tensor, Tensor]:
        """Row `row`'s keys and values, [L, Hkv, length, D] each (a copy)."""
        blocks, within = self._locate(row, range(self.lengths[row]))
        k = self.pool.k[:, blocks, :, within]  # [length, L, Hkv, D]
        v = self.pool.v[:, blocks, :, within]
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep the active rows `rows` (increasing), as rows 0, 1, ...; drop the others
        (finished sequences): their blocks go back to the pool, the last first (nothing is
        copied)."""
        rows = list(rows)
        if any(b <= a for a, b in itertools.pairwise(rows)) or (
            rows and not 0 <= rows[0] <= rows[-1] < self.batch_size
        ):
            raise ValueError(f"keep_rows needs increasing active rows, got {rows}")
        kept = set(rows)
        for index, table in enumerate(self.tables):
            if index not in kept:
                self.pool.release(reversed(table))
        self.tables[:] = [self.tables[r] for r in rows]
        self.lengths[:] = [self.lengths[r] for r in rows]
