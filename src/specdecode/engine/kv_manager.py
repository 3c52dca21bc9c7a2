"""The KV manager: the running requests' cache rows and the prefix cache beside them (vLLM's
`KVCacheManager`).

The scheduler decides who runs and counts the blocks they may hold (`engine/scheduler.py`);
this module holds those blocks. Row b of `cache` belongs to the scheduler's running request b.
A request's row is empty when it joins (`add_rows`) and starts from the prefix cache's hit
before its first prefill pass (`start`); its full blocks enter the prefix cache after each
prefill pass (`store`) and when it leaves the batch, finished (`keep`) or preempted
(`preempt`), so a later prompt that starts the same way, or the same request resumed, skips
their prefill. The pool holds up to `kv_cache_tokens` slots for the rows and
`prefix_cache_tokens` of idle cached blocks beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.cache.kv_cache import KVCache
from specdecode.cache.prefix_cache import PrefixCache
from specdecode.engine.request import Request
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.model.transformer import Transformer


class KVManager:
    """Cache rows for `model`'s running requests under `config`'s limits; `reads_states`: the
    drafter reads the target's hidden states at every prompt token (a head's catch-up), so no
    prompt may start from the prefix cache (it keeps keys and values, not states)."""

    def __init__(self, model: Transformer, config: SchedulerConfig, reads_states: bool) -> None:
        self.model = model
        self.config = config
        tokens = config.prefix_cache_tokens
        self.prefix_cache = PrefixCache(tokens) if tokens else None
        self.cache: KVCache | None = None  # made when the first request joins
        self._reads_states = reads_states

    @property
    def prefix_hits(self) -> bool:
        """Whether a prompt may start from the prefix cache: a cache is kept and the drafter
        does not need the target's states at every prompt token."""
        return self.prefix_cache is not None and not self._reads_states

    @property
    def exact_prefill(self) -> bool:
        """Under prefix caching or chunked prefill, a prefill attends per token (DECODE), as
        decoding does: a token's keys and values then have the same bits however the
        sequence was split into passes and whichever prompts shared the pass, so a hit, a
        chunked prefill and a batch of prompts give exactly what one cold pass gives
        (row-exact formats). Else a prompt is one batched attention (PREFILL), alone."""
        return self.prefix_cache is not None or self.config.chunked_prefill

    def usage(self) -> float:
        """The share of the KV cache the rows hold (0..1): blocks held over the blocks
        `kv_cache_tokens` allows, or over the pool's blocks without a limit."""
        if self.cache is None:
            return 0.0
        limit = self.config.max_blocks or self.cache.pool.num_blocks
        return self.cache.num_blocks / limit if limit else 0.0

    def add_rows(self, count: int) -> None:
        """Give `count` joining requests an empty row each (their blocks come as they fill)."""
        if not count:
            return
        if self.cache is None:
            limit = self.config.kv_cache_tokens
            if limit is not None:
                limit += self.config.prefix_cache_tokens
            self.cache = self.model.new_cache(0, 0, limit)
        self.cache.add_rows(count)

    def start(self, req: Request, row: int) -> int:
        """Before `req`'s first prefill pass, load the prefix cache's hit into its `row` (its
        tokens count as computed); returns the prompt tokens still to prefill."""
        assert self.cache is not None  # add_rows made it
        prompt = req.prefill_ids
        if req.num_computed_tokens == 0:
            hit = 0
            if self.prefix_hits:
                assert self.prefix_cache is not None
                view = self.cache.row(row)
                hit = self.prefix_cache.load(prompt, view)
                self.cache.set_length(row, view.lengths[0])
            if not req.num_preemptions:
                req.num_cached_tokens = hit  # of the prompt, as the usage reports it
            req.num_computed_tokens = hit
        return len(prompt) - req.num_computed_tokens

    def store(self, token_ids: Sequence[int], cache: KVCache, row: int) -> None:
        """Enter the full blocks of `token_ids` that row `row` of `cache` (the rows or a view
        of some) holds, where prompts may start from them."""
        if self.prefix_hits:
            assert self.prefix_cache is not None
            self.prefix_cache.store(token_ids, cache, row)

    def preempt(self, taken: Sequence[Request], running: int) -> None:
        """Free the rows of the requests `taken` back to the queue, newest first (the last of
        the `running` rows); their full blocks stay in the prefix cache, so most of their
        prefill again is a hit."""
        if not taken or self.cache is None:
            return
        for row, req in zip(range(running - 1, -1, -1), taken, strict=False):
            self.store(req.token_ids, self.cache, row)
        self.cache.keep_rows(range(running - len(taken)))

    def keep(self, running: Sequence[Request]) -> list[int]:
        """Free the rows of the finished (and aborted) requests among `running` (their blocks
        enter the prefix cache first); returns the rows kept, in order."""
        keep = [row for row, req in enumerate(running) if not req.finished]
        if self.cache is not None and len(keep) < len(running):
            for row, req in enumerate(running):
                if req.finished:
                    self.store(req.token_ids, self.cache, row)
            self.cache.keep_rows(keep)
        return keep

    def clear(self) -> None:
        """Drop every row (e.g. after a step failed midway, when rows may hold half a step)."""
        self.cache = None
