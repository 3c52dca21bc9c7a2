"""A drafter model's KV cache: one row per request in one pool, so that a pass can feed every
request's next draft token at once.

`DraftRows` maps request ids to the rows of one `KVCache` (its rows grow with
`KVCache.add_rows`). A batched pass (`feed_rows`) runs over every active row: the rows that feed
tokens this pass get them, the others ride along as padding (num_new 0: computed, never kept),
so a pass costs one read of the draft model's weights whatever the number of rows. Work on one
request alone (a prompt's prefill, a tree, a staged draft) goes through a one-row view of its
row (`view`), whose length is stored back with `store`; work on some of them (a block
drafter's contexts and blocks, `drafters.dflash`) through a view of those rows (`select`,
`store_rows`).

Released requests leave their row at once but their blocks only at the next `place`, where
every released row is dropped in one `KVCache.keep_rows` (nothing is copied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache


class DraftRows:
    """The KV rows of a drafter's model, keyed by request id.

    Args:
        new_cache: makes an empty cache of (rows, capacity) for the drafter's model.
    """

    def __init__(self, new_cache: Callable[[int, int], KVCache]) -> None:
        self._new_cache = new_cache
        self._cache: KVCache | None = None
        self._ids: list[str | None] = []  # per active row: its request, None once released

    def __len__(self) -> int:
        """Requests holding a row."""
        return sum(rid is not None for rid in self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def place(self, request_ids: Sequence[str], capacity: int) -> list[int]:
        """The row of each request (new ones get an empty row; the first call's cache starts
        with its rows and a pool with room for `capacity` slots each, later rows come with
        `KVCache.add_rows` and the pool grows as they fill); rows of released requests are
        dropped first."""
        self._drop_released()
        known = {rid: row for row, rid in enumerate(self._ids)}
        new = [rid for rid in dict.fromkeys(request_ids) if rid not in known]
        if self._cache is None:
            self._cache = self._new_cache(len(new), capacity)
        elif new:
            self._cache.add_rows(len(new))
        if new:
            known.update((rid, len(self._ids) + i) for i, rid in enumerate(new))
            self._ids.extend(new)
        return [known[rid] for rid in request_ids]

    def length(self, row: int) -> int:
        """Slots row `row` holds."""
        assert self._cache is not None  # place made it
        return self._cache.lengths[row]

    def cached(self, request_id: str) -> int:
        """Slots the request's row holds (0 before it has a row)."""
        row = self._row(request_id)
        return 0 if row is None else self.length(row)

    def truncate(self, request_id: str, length: int) -> None:
        """Roll the request's row back to at most `length` slots (unknown ids are ignored)."""
        row = self._row(request_id)
        if row is not None:
            self._cache.set_length(row, min(self.length(row), length))  # type: ignore[union-attr]

    def _row(self, request_id: str) -> int | None:
        """The request's row, None before it has one."""
        if self._cache is None or request_id not in self._ids:
            return None
        return self._ids.index(request_id)

    def release(self, request_id: str) -> None:
        """Forget a request; its row is dropped at the next `place` (unknown ids are ignored)."""
        if request_id in self._ids:
            self._ids[self._ids.index(request_id)] = None

    def view(self, row: int) -> KVCache:
        """A one-row cache over `row`'s storage holding its slots (passes on it write into the
        row in place); `store` its length afterwards."""
        return self.select([row])

    def store(self, row: int, view: KVCache) -> None:
        """Row `row` holds what its `view` holds now."""
        self.store_rows([row], view)

    def select(self, rows: Sequence[int]) -> KVCache:
        """A cache over `rows` (in that order; passes on it write into the rows in place)
        holding their slots; `store_rows` their lengths afterwards."""
        assert self._cache is not None  # place made it
        return self._cache.select(rows)

    def store_rows(self, rows: Sequence[int], view: KVCache) -> None:
        """Rows `rows` hold what a `select(rows)` view holds now."""
        assert self._cache is not None  # place made it
        for row, length in zip(rows, view.lengths, strict=True):
            self._cache.set_length(row, length)

    def feed_rows(
        self,
        model: Callable[..., tuple[Tensor, Tensor]],
        new: dict[int, list[int]],
        max_positions: int,
    ) -> Tensor:
        """One DECODE pass of `model` over every row: row r feeds `new[r]` (at least one token)
        after its cached slots, the other rows nothing (their padding's positions are clamped
        below `max_positions`); the logits ([len(new), V], in the order of `new`) after each
        fed row's last token."""
        cache = self._cache
        assert cache is not None and new  # place made it
        device = cache.device
        sizes = [len(new.get(row, ())) for row in range(cache.batch_size)]
        width = max(sizes)
        tokens = torch.zeros(cache.batch_size, width, dtype=torch.long)  # [R, T]
        for row, ids in new.items():
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        meta = AttentionMetadata.contiguous(
            AttentionMode.DECODE, cache.lengths, sizes, device, max_positions=max_positions
        )
        last = torch.tensor([max(n - 1, 0) for n in sizes], device=device)[:, None]  # [R, 1]
        logits, _ = model(tokens.to(device), meta, cache, logits_index=last)  # [R, 1, V]
        return logits[list(new), 0]

    def _drop_released(self) -> None:
        """Drop the rows of released requests (one `keep_rows`)."""
        if self._cache is None or all(rid is not None for rid in self._ids):
            return
        keep = [row for row, rid in enumerate(self._ids) if rid is not None]
        self._cache.keep_rows(keep)
        self._ids = [self._ids[row] for row in keep]
