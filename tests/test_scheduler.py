"""The scheduler's admission rules (hand-built requests, no model) and the paged KV cache's rows
and blocks (hand-made keys/values compared exactly)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.block_pool import BLOCK_TOKENS, KVCacheFull, blocks_for
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.engine.request import Request
from specdecode.engine.scheduler import Scheduler, SchedulerConfig, kv_need, step_blocks
from specdecode.errors import UserError
from specdecode.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int = 8) -> Request:
    """A greedy request with a `prompt_len`-token prompt (its kv_need: prompt_len +
    max_tokens + MAX_SPECULATIVE_TOKENS)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [1 + i % 200 for i in range(prompt_len)]
    return Request(f"r{next(_ids)}", None, prompt, params, (), max_context=100_000)


def need(prompt_len: int, max_tokens: int) -> int:
    return prompt_len + max_tokens + MAX_SPECULATIVE_TOKENS


def queued(config: SchedulerConfig, *reqs: Request) -> Scheduler:
    sched = Scheduler(config)
    for req in reqs:
        sched.add(req)
    return sched


# -- SchedulerConfig -----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens"])
@pytest.mark.parametrize("value", [0, -3, True, False, 2.0, "4"])
def test_config_refuses_bad_values(field: str, value: object) -> None:
    with pytest.raises(UserError, match=field):
        SchedulerConfig(**{field: value})


def test_config_accepts_good_values() -> None:
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, kv_cache_tokens=1)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_tokens) == (1, 1, 1)
    assert SchedulerConfig().kv_cache_tokens is None


# -- admit ---------------------------------------------------------------------------------


def test_kv_need_counts_prompt_max_tokens_and_draft_room() -> None:
    assert kv_need(make_request(7, 5)) == 7 + 5 + MAX_SPECULATIVE_TOKENS


def test_admit_respects_max_num_seqs() -> None:
    reqs = [make_request(4) for _ in range(4)]
    sched = queued(SchedulerConfig(max_num_seqs=2), *reqs)
    assert sched.admit(0) == reqs[:2]
    assert sched.running == reqs[:2] and list(sched.waiting) == reqs[2:]
    assert sched.admit(0) == []  # full
    sched.running.remove(reqs[0])  # a request left
    assert sched.admit(0) == [reqs[2]]
    assert sched.running == [reqs[1], reqs[2]] and list(sched.waiting) == [reqs[3]]


def test_admit_never_overtakes_the_head() -> None:
    """B's prompt exceeds what A left of the budget; C would fit but must wait behind B."""
    a, b, c = make_request(8), make_request(15), make_request(2)
    sched = queued(SchedulerConfig(max_num_batched_tokens=20), a, b, c)
    assert sched.admit(0) == [a]  # A takes 8 + 1: 11 left, B needs 15 + 1
    assert list(sched.waiting) == [b, c]
    # Next step: 20 - A's 1 verification token = 19: B (15 + 1) then C (2 + 1) fit.
    assert sched.admit(0) == [b, c]
    assert sched.running == [a, b, c] and not sched.waiting


def test_admit_budget_counts_running_verification_tokens() -> None:
    first = [make_request(3), make_request(3)]
    sched = queued(SchedulerConfig(max_num_batched_tokens=30), *first)
    assert sched.admit(4) == first
    big, mid, small = make_request(12), make_request(8), make_request(1)
    for req in (big, mid, small):
        sched.add(req)
    # K = 5: budget 30 - 2 * 6 = 18: big takes 12 + 6 (0 left), then mid stops the step.
    assert sched.admit(5) == [big]
    assert list(sched.waiting) == [mid, small]
    sched.running = list(first)  # rewind: K = 0 leaves 30 - 2 = 28: 13 + 9 + 2 fit
    sched.waiting.appendleft(big)
    assert sched.admit(0) == [big, mid, small]
    assert not sched.waiting


def test_first_request_of_a_step_exceeds_the_budget() -> None:
    long, short = make_request(50), make_request(1)
    sched = queued(SchedulerConfig(max_num_batched_tokens=10), long, short)
    assert sched.admit(0) == [long]  # alone, although 50 > 10: no prompt waits forever
    assert list(sched.waiting) == [short]
    # Next step: the running request's 1 + K tokens already exceed the budget (1 + 12 > 10);
    # the head is still the first of its step, so it is admitted.
    assert sched.admit(12) == [short]
    assert sched.running == [long, short]


def test_budget_exhausted_stops_later_requests() -> None:
    reqs = [make_request(1) for _ in range(5)]
    sched = queued(SchedulerConfig(max_num_batched_tokens=6), *reqs)
    assert sched.admit(0) == reqs[:3]  # (1 + 1) x 3 = 6; the fourth would make 8
    # Next step: 3 running x (1 + 0) tokens leave 3: the fourth takes 2, the fifth does not fit.
    assert sched.admit(0) == [reqs[3]]
    assert list(sched.waiting) == [reqs[4]]


def blocks(prompt: int, max_tokens: int) -> int:
    """KV blocks a request of this shape may come to hold."""
    return blocks_for(need(prompt, max_tokens))


def test_kv_cache_limit_is_the_blocks_requests_hold_through_the_next_step() -> None:
    """Paged: a request counts the blocks of its committed tokens + 1 + K (not its whole
    max_tokens): a long and two short requests run side by side where the rectangle (rows x
    the longest need) held one; another long one waits."""
    long, short, other, long2 = (make_request(n, 5) for n in (60, 3, 3, 60))
    k = 4
    assert step_blocks(short, k) == blocks_for(3 + 1 + k) == 1
    assert step_blocks(long, k) == blocks_for(60 + 1 + k) == 5
    limit = blocks(60, 5) * BLOCK_TOKENS  # 9 blocks: the long one fits alone
    assert 2 * need(60, 5) > limit  # the rectangle held one row
    sched = queued(SchedulerConfig(kv_cache_tokens=limit), long, short, other, long2)
    assert sched.admit(k) == [long, short, other]  # 5 + 1 + 1 blocks
    assert list(sched.waiting) == [long2]  # 7 + 5 > 9
    sched.running.remove(short)  # it finished: 6 + 5 > 9 still
    assert sched.admit(k) == []
    sched.running.remove(long)
    assert sched.admit(k) == [long2]


def test_kv_cache_limit_keeps_fcfs() -> None:
    """The head does not fit beside the running request; a smaller one behind it would."""
    running, head, small = make_request(60, 5), make_request(60, 5), make_request(3, 3)
    limit = blocks(60, 5) * BLOCK_TOKENS  # 9 blocks; 5 + 5 do not fit
    sched = queued(SchedulerConfig(kv_cache_tokens=limit), running)
    assert sched.admit(4) == [running]
    sched.add(head)
    sched.add(small)
    assert sched.admit(4) == []
    assert list(sched.waiting) == [head, small]


def test_preempt_takes_the_newest_back_to_the_head_of_the_queue() -> None:
    reqs = [make_request(30, 20) for _ in range(3)]
    limit = blocks(30, 20) * BLOCK_TOKENS  # 8 blocks
    sched = queued(SchedulerConfig(kv_cache_tokens=limit), *reqs)
    assert sched.admit(1) == reqs and sched.preempt(1) == []  # 2 blocks each
    waiting = make_request(30, 20)
    sched.add(waiting)
    for req in reqs:
        req.num_computed_tokens = 30  # prefilled
        req.append([5, 6, 7])  # each grows to 33 + 1 + 1 tokens: 3 blocks
    assert sched.preempt(1) == [reqs[2]]  # the newest; 6 blocks are left
    assert sched.running == reqs[:2]
    assert list(sched.waiting) == [reqs[2], waiting]
    resumed = reqs[2]
    assert resumed.num_preemptions == 1 and resumed.prefilling
    assert resumed.num_computed_tokens == 0
    assert resumed.prefill_ids == resumed.token_ids[:-1]  # the last is the next step's input
    assert sched.admit(1) == []  # 6 + 3 > 8: it waits for room
    sched.running.remove(reqs[0])  # it finished
    assert sched.admit(1) == [resumed, waiting]  # 3 + 3 + 2


def test_preempt_during_the_prefill_starts_the_prompt_again_and_keeps_the_oldest() -> None:
    first, second = make_request(20, 60), make_request(20, 60)
    limit = blocks(20, 60) * BLOCK_TOKENS  # 9 blocks
    sched = queued(SchedulerConfig(kv_cache_tokens=limit), first, second)
    assert sched.admit(20) == [first, second]  # 20 + 1 + 20 tokens: 3 blocks each
    second.num_computed_tokens = 16  # a chunk of its prompt is in
    first.append([1] * 59)  # 79 + 1 + 20 tokens: 7 blocks, beside the second's 3
    assert sched.preempt(20) == [second]
    assert second.prefill_ids == second.prompt_ids and second.num_computed_tokens == 0
    assert sched.preempt(40) == []  # the oldest always stays, whatever it needs


def test_check_fits_refuses_a_request_that_could_never_fit() -> None:
    limit = blocks(30, 6) * BLOCK_TOKENS
    prompt = limit - need(0, 6)  # the longest prompt whose blocks fit
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=limit))
    sched.add(make_request(prompt, 6))  # exactly fits: accepted
    too_big = make_request(prompt + 1, 6)
    with pytest.raises(UserError, match=rf"needs {limit + 1} KV cache slots.*holds {limit}"):
        sched.add(too_big)
    assert too_big not in sched.waiting and len(sched.waiting) == 1
    with pytest.raises(UserError, match=f"{prompt + 1} prompt tokens"):
        sched.check_fits(too_big)
    Scheduler(SchedulerConfig()).check_fits(make_request(5000, 5000))  # no limit: fits


def test_remove_waiting() -> None:
    a, b, c = make_request(2), make_request(2), make_request(2)
    sched = queued(SchedulerConfig(max_num_seqs=1), a, b, c)
    assert sched.admit(0) == [a]
    assert sched.remove_waiting(b.request_id) is b
    assert list(sched.waiting) == [c]
    assert sched.remove_waiting(b.request_id) is None  # already gone
    assert sched.remove_waiting(a.request_id) is None  # running, not waiting
    assert sched.remove_waiting("nope") is None
    assert sched.running == [a] and list(sched.waiting) == [c]


# -- KVCache: paged rows ---------------------------------------------------------------------

LAYERS, HEADS, DIM = 2, 2, 3


def empty_cache(max_tokens: int | None = None) -> KVCache:
    return KVCache(LAYERS, 0, HEADS, DIM, 0, torch.float32, max_tokens=max_tokens)


def fill_row(cache: KVCache, index: int, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Write `length` random keys/values into row `index` through a `row` view (the engine's
    prefill path) and set its length; returns the [L, Hkv, length, D] keys and values."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, 1, length, HEADS, DIM, generator=gen)  # [L, 1, T, Hkv, D]
    v = torch.randn(LAYERS, 1, length, HEADS, DIM, generator=gen)
    view = cache.row(index)
    meta = AttentionMetadata.prefill([length], "cpu")
    view.prepare(meta)
    for layer in range(LAYERS):
        view.write(layer, k[layer], v[layer])
    view.advance(meta)
    cache.set_length(index, view.lengths[0])
    return k[:, 0].transpose(1, 2), v[:, 0].transpose(1, 2)  # [L, Hkv, T, D]


def assert_row(cache: KVCache, index: int, kv: tuple[torch.Tensor, ...]) -> None:
    k, v = kv
    assert cache.lengths[index] == k.shape[2]
    got_k, got_v = cache.gather(index)
    assert torch.equal(got_k, k)
    assert torch.equal(got_v, v)


def held(cache: KVCache) -> int:
    """Blocks the pool has handed out and not taken back."""
    return cache.pool.blocks_in_use


def test_rows_hold_whole_blocks_of_their_own() -> None:
    cache = empty_cache()
    assert cache.add_rows(3) == [0, 1, 2]
    row0 = fill_row(cache, 0, 5, seed=0)
    row2 = fill_row(cache, 2, BLOCK_TOKENS + 1, seed=2)
    row1 = fill_row(cache, 1, 4, seed=1)
    assert cache.lengths == [5, 4, BLOCK_TOKENS + 1]
    for index, kv in enumerate((row0, row1, row2)):
        assert_row(cache, index, kv)
    assert [len(t) for t in cache.tables] == [1, 1, 2]
    assert held(cache) == 4 and len({b for t in cache.tables for b in t}) == 4


def test_a_selection_of_rows_writes_into_them_in_its_order() -> None:
    """`select([2, 0])`: one pass over rows 2 and 0 (in that order) appends to each in place;
    row 1 is untouched; their lengths come back with `set_length`."""
    cache = empty_cache()
    cache.add_rows(3)
    rows = [fill_row(cache, i, n, seed=i) for i, n in enumerate((3, 5, BLOCK_TOKENS - 1))]
    view = cache.select([2, 0])
    assert view.lengths == [BLOCK_TOKENS - 1, 3]
    meta = AttentionMetadata.contiguous(AttentionMode.DECODE, view.lengths, [2, 1], "cpu")
    new = tuple(torch.randn(LAYERS, 2, 2, HEADS, DIM) for _ in range(2))  # [L, 2, T, Hkv, D]
    view.prepare(meta)
    for layer in range(LAYERS):
        view.write(layer, new[0][layer], new[1][layer])
    view.advance(meta)
    for index, length in zip([2, 0], view.lengths, strict=True):
        cache.set_length(index, length)
    for index, at, n in ((2, 0, 2), (0, 1, 1)):
        added = tuple(x[:, at, :n].transpose(1, 2) for x in new)  # [L, Hkv, n, D]
        want = tuple(torch.cat([a, b], dim=2) for a, b in zip(rows[index], added, strict=True))
        assert_row(cache, index, want)
    assert_row(cache, 1, rows[1])
    with pytest.raises(ValueError, match=r"rows \[0, 3\]: the cache has 3 active"):
        cache.select([0, 3])
    with pytest.raises(ValueError, match="the cache has 3 active"):
        cache.select([])


def test_row_and_set_length_refuse_bad_arguments() -> None:
    cache = empty_cache()
    cache.add_rows(2)
    fill_row(cache, 0, 3, seed=0)
    with pytest.raises(ValueError, match="not active"):
        cache.row(2)
    with pytest.raises(ValueError, match="not active"):
        cache.row(-1)
    with pytest.raises(ValueError, match="outside"):
        cache.set_length(0, BLOCK_TOKENS + 1)  # past the row's one block


def test_truncate_and_advance_return_blocks_past_the_length() -> None:
    cache = empty_cache()
    cache.add_rows(1)
    kv = fill_row(cache, 0, 3 * BLOCK_TOKENS, seed=0)
    assert held(cache) == 3
    cache.truncate([BLOCK_TOKENS + 2])
    assert held(cache) == 2 and len(cache.tables[0]) == 2
    assert_row(cache, 0, tuple(x[:, :, : BLOCK_TOKENS + 2] for x in kv))
    # a pass wider than the row's tokens holds blocks for its padding only while it runs
    meta = AttentionMetadata.contiguous(AttentionMode.DECODE, cache.lengths, [1], "cpu", 20)
    cache.prepare(meta)
    assert len(cache.tables[0]) == 3
    cache.advance(meta)
    assert cache.lengths == [BLOCK_TOKENS + 3] and held(cache) == 2


def test_pool_limit_refuses_and_changes_nothing() -> None:
    cache = empty_cache(max_tokens=2 * BLOCK_TOKENS)
    cache.add_rows(2)
    fill_row(cache, 0, BLOCK_TOKENS + 1, seed=0)
    meta = AttentionMetadata.prefill([BLOCK_TOKENS + 1], "cpu")
    with pytest.raises(KVCacheFull, match="KV cache full"):
        cache.row(1).prepare(meta)
    assert cache.tables[1] == [] and held(cache) == 2
    cache.keep_rows([1])  # row 0 finishes: its blocks come back
    assert held(cache) == 0
    fill_row(cache, 0, 2 * BLOCK_TOKENS, seed=1)


def test_memory_follows_tokens_not_the_longest_row() -> None:
    """One long and many short rows: the pool holds their tokens in whole blocks (<= 1.1x
    here), where a rectangular cache held rows x the longest."""
    cache = empty_cache()
    lengths = [1000] + [40] * 15
    cache.add_rows(len(lengths))
    for index, n in enumerate(lengths):
        fill_row(cache, index, n, seed=index)
    tokens = sum(lengths)
    assert held(cache) * BLOCK_TOKENS <= 1.1 * tokens
    assert cache.pool.num_blocks * BLOCK_TOKENS < len(lengths) * max(lengths) / 4


def test_compact_moves_kept_tree_slots_across_blocks() -> None:
    cache = empty_cache()
    cache.add_rows(1)
    kv = fill_row(cache, 0, BLOCK_TOKENS - 2, seed=0)  # the tree starts 2 slots before a block ends
    meta = AttentionMetadata.contiguous(AttentionMode.DECODE, cache.lengths, [5], "cpu")
    nodes = tuple(torch.randn(LAYERS, 1, 5, HEADS, DIM) for _ in range(2))  # [L, 1, 5, Hkv, D]
    cache.prepare(meta)
    for layer in range(LAYERS):
        cache.write(layer, nodes[0][layer], nodes[1][layer])
    cache.advance(meta)
    cache.compact([BLOCK_TOKENS - 2], [[0, 2, 4]])
    assert cache.lengths == [BLOCK_TOKENS + 1] and len(cache.tables[0]) == 2
    kept = tuple(x[:, 0, [0, 2, 4]].transpose(1, 2) for x in nodes)  # [L, Hkv, 3, D]
    want = tuple(torch.cat([a, b], dim=2) for a, b in zip(kv, kept, strict=True))
    assert_row(cache, 0, want)


@pytest.mark.parametrize("keep", [[1, 3], [0, 2, 3], [3], [0, 1, 2, 3], []])
def test_keep_rows_keeps_rows_and_frees_the_others(keep: list[int]) -> None:
    cache = empty_cache()
    cache.add_rows(4)
    lengths = [3, 1, BLOCK_TOKENS + 6, 2]
    rows = [fill_row(cache, i, n, seed=i) for i, n in enumerate(lengths)]
    cache.keep_rows(keep)
    assert cache.batch_size == len(keep)
    assert cache.lengths == [lengths[r] for r in keep]
    for dst, src in enumerate(keep):
        assert_row(cache, dst, rows[src])
    assert held(cache) == sum(blocks_for(lengths[r]) for r in keep)


def test_keep_rows_then_add_rows_reuses_freed_blocks() -> None:
    cache = empty_cache()
    cache.add_rows(3)
    rows = [fill_row(cache, i, n, seed=i) for i, n in enumerate([4, 5, 2])]
    cache.keep_rows([0, 2])
    pool = cache.pool.num_blocks
    assert cache.add_rows(2) == [2, 3]
    fresh = fill_row(cache, 3, 12, seed=9)
    assert cache.lengths == [4, 2, 0, 12]
    assert cache.pool.num_blocks == pool  # the freed block was reused
    assert_row(cache, 0, rows[0])
    assert_row(cache, 1, rows[2])
    assert_row(cache, 3, fresh)


@pytest.mark.parametrize("bad", [[1, 1], [2, 1], [0, 3], [-1, 0], [3]])
def test_keep_rows_refuses_rows_not_increasing_or_not_active(bad: list[int]) -> None:
    cache = empty_cache()
    cache.add_rows(3)
    rows = [fill_row(cache, i, 2, seed=i) for i in range(3)]
    with pytest.raises(ValueError, match="increasing active rows"):
        cache.keep_rows(bad)
    assert cache.batch_size == 3  # unchanged
    for index, kv in enumerate(rows):
        assert_row(cache, index, kv)
