"""The scheduler's admission rules (hand-built requests, no model) and the KV cache's row pool
(hand-made keys/values compared exactly)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.engine.request import Request
from specdecode.engine.scheduler import Scheduler, SchedulerConfig, kv_need
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


def test_kv_cache_limit_is_rows_times_longest_need() -> None:
    """Sum of needs fits, the rectangle (rows x longest) does not: the request waits."""
    short, long = make_request(3, 3), make_request(26, 10)
    n_short, n_long = need(3, 3), need(26, 10)
    limit = n_short + n_long + 5  # sum fits; 2 x n_long does not
    assert 2 * n_long > limit
    sched = queued(SchedulerConfig(kv_cache_tokens=limit), short, long)
    assert sched.admit(0) == [short]
    assert list(sched.waiting) == [long]
    assert sched.capacity() == n_short
    assert sched.admit(0) == []  # still no room
    sched.running.remove(short)  # it finished
    assert sched.admit(0) == [long]
    assert sched.capacity() == n_long
    # The other way round: a long request running keeps a short one out too.
    other = make_request(3, 3)
    sched.add(other)
    assert sched.admit(0) == []
    assert list(sched.waiting) == [other]


def test_kv_cache_limit_admits_up_to_the_rectangle() -> None:
    reqs = [make_request(10, 10) for _ in range(3)]
    sched = queued(SchedulerConfig(kv_cache_tokens=2 * need(10, 10)), *reqs)
    assert sched.admit(0) == reqs[:2]
    assert list(sched.waiting) == [reqs[2]]
    sched.running.pop(0)
    assert sched.admit(0) == [reqs[2]]
    assert sched.running == [reqs[1], reqs[2]]


def test_kv_cache_limit_keeps_fcfs() -> None:
    """The head does not fit beside the running request; a smaller one behind it would."""
    running, head, small = make_request(3, 3), make_request(40, 10), make_request(3, 3)
    limit = 2 * need(3, 3) + 10  # two small ones fit; small + head does not
    sched = queued(SchedulerConfig(kv_cache_tokens=limit), running)
    assert sched.admit(0) == [running]
    sched.add(head)
    sched.add(small)
    assert sched.admit(0) == []
    assert list(sched.waiting) == [head, small]


def test_check_fits_refuses_a_request_that_could_never_fit() -> None:
    limit = need(30, 6)
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=limit))
    sched.add(make_request(30, 6))  # exactly fits: accepted
    too_big = make_request(31, 6)
    with pytest.raises(UserError, match=rf"needs {limit + 1} KV cache slots.*holds {limit}"):
        sched.add(too_big)
    assert too_big not in sched.waiting and len(sched.waiting) == 1
    with pytest.raises(UserError, match="31 prompt tokens"):
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


# -- KVCache row pool ----------------------------------------------------------------------

LAYERS, HEADS, DIM = 2, 2, 3


def empty_cache(capacity: int = 4) -> KVCache:
    return KVCache(LAYERS, 0, HEADS, DIM, capacity, torch.float32)


def fill_row(cache: KVCache, index: int, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Write `length` random keys/values into row `index` through a `row` view (the engine's
    prefill path) and set its length; returns the [L, Hkv, length, D] keys and values."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, 1, length, HEADS, DIM, generator=gen)  # [L, 1, T, Hkv, D]
    v = torch.randn(LAYERS, 1, length, HEADS, DIM, generator=gen)
    view = cache.row(index)
    meta = AttentionMetadata.prefill([length], "cpu")
    for layer in range(LAYERS):
        view.write(layer, k[layer], v[layer], meta, meta.write_slots())
    view.advance(meta)
    cache.set_length(index, view.lengths[0])
    return k[:, 0].transpose(1, 2), v[:, 0].transpose(1, 2)  # [L, Hkv, T, D]


def assert_row(cache: KVCache, index: int, kv: tuple[torch.Tensor, ...]) -> None:
    k, v = kv
    n = k.shape[2]
    assert cache.lengths[index] == n
    assert torch.equal(cache.k[:, index, :, :n], k)
    assert torch.equal(cache.v[:, index, :, :n], v)


def test_row_view_writes_into_its_row_only() -> None:
    cache = empty_cache(6)
    assert cache.add_rows(3, 6) == [0, 1, 2]
    row0 = fill_row(cache, 0, 5, seed=0)
    row2 = fill_row(cache, 2, 2, seed=2)
    row1 = fill_row(cache, 1, 4, seed=1)
    assert cache.lengths == [5, 4, 2]
    for index, kv in enumerate((row0, row1, row2)):
        assert_row(cache, index, kv)
    assert not cache.k[:, 2, :, 2:].any()  # row 1's write did not spill into row 2's slots


def test_row_and_set_length_refuse_bad_arguments() -> None:
    cache = empty_cache(4)
    cache.add_rows(2, 4)
    with pytest.raises(ValueError, match="not active"):
        cache.row(2)
    with pytest.raises(ValueError, match="not active"):
        cache.row(-1)
    with pytest.raises(ValueError, match="outside"):
        cache.set_length(0, cache.capacity + 1)


def test_add_rows_keeps_data_when_growing_rows_and_slots() -> None:
    cache = empty_cache(4)
    assert cache.add_rows(2, 4) == [0, 1]
    rows = [fill_row(cache, 0, 3, seed=0), fill_row(cache, 1, 4, seed=1)]
    assert cache.add_rows(3, 10) == [2, 3, 4]  # more rows and more slots at once
    assert cache.batch_size == 5 and cache.lengths == [3, 4, 0, 0, 0]
    assert cache.capacity >= 10 and cache.pool_rows >= 5
    assert cache.k.shape == (LAYERS, 5, HEADS, cache.capacity, DIM)
    for index, kv in enumerate(rows):
        assert_row(cache, index, kv)
    rows.append(fill_row(cache, 4, 10, seed=4))  # a new row holds the new capacity
    assert cache.add_rows(1, 30) == [5]  # slots only (the pool has spare rows or grows)
    for index, kv in zip((0, 1, 4), rows, strict=True):
        assert_row(cache, index, kv)


def test_add_rows_reuses_the_pool_when_it_has_room() -> None:
    cache = empty_cache(8)
    cache.add_rows(4, 8)
    rows, slots = cache.pool_rows, cache.capacity
    kept = fill_row(cache, 3, 5, seed=3)
    cache.keep_rows([3])
    assert cache.add_rows(2, 6) == [1, 2]
    assert (cache.pool_rows, cache.capacity) == (rows, slots)
    assert cache.lengths == [5, 0, 0]
    assert_row(cache, 0, kept)


def test_add_rows_respects_max_slots() -> None:
    cache = empty_cache(8)
    limit = 30
    data = {}
    for step, (count, capacity) in enumerate([(1, 8), (1, 10), (1, 10)]):
        first = cache.batch_size
        assert cache.add_rows(count, capacity, limit) == list(range(first, first + count))
        assert cache.capacity >= capacity
        assert cache.pool_rows >= cache.batch_size
        assert cache.pool_rows * cache.capacity <= limit, (cache.pool_rows, cache.capacity)
        data[first] = fill_row(cache, first, min(capacity, 7 + step), seed=step)
        for index, kv in data.items():
            assert_row(cache, index, kv)
    assert cache.batch_size == 3


def test_add_rows_max_slots_many_small_rows() -> None:
    cache = empty_cache(4)
    data = {}
    for index in range(6):
        cache.add_rows(1, 5, max_slots=30)
        assert cache.pool_rows * cache.capacity <= 30
        assert cache.capacity >= 5
        data[index] = fill_row(cache, index, 5, seed=index)
    for index, kv in data.items():
        assert_row(cache, index, kv)


@pytest.mark.parametrize("keep", [[1, 3], [0, 2, 3], [3], [0, 1, 2, 3], []])
def test_keep_rows_moves_kept_rows_down(keep: list[int]) -> None:
    cache = empty_cache(6)
    cache.add_rows(4, 6)
    rows = [fill_row(cache, i, n, seed=i) for i, n in enumerate([3, 1, 6, 2])]
    cache.keep_rows(keep)
    assert cache.batch_size == len(keep)
    assert cache.lengths == [rows[r][0].shape[2] for r in keep]
    for dst, src in enumerate(keep):
        assert_row(cache, dst, rows[src])


def test_keep_rows_then_add_rows_leaves_kept_rows_intact() -> None:
    cache = empty_cache(6)
    cache.add_rows(3, 6)
    rows = [fill_row(cache, i, n, seed=i) for i, n in enumerate([4, 5, 2])]
    cache.keep_rows([0, 2])
    assert cache.add_rows(2, 12) == [2, 3]
    fresh = fill_row(cache, 3, 12, seed=9)
    assert cache.lengths == [4, 2, 0, 12]
    assert_row(cache, 0, rows[0])
    assert_row(cache, 1, rows[2])
    assert_row(cache, 3, fresh)


@pytest.mark.parametrize("bad", [[1, 1], [2, 1], [0, 3], [-1, 0], [3]])
def test_keep_rows_refuses_rows_not_increasing_or_not_active(bad: list[int]) -> None:
    cache = empty_cache(4)
    cache.add_rows(3, 4)
    rows = [fill_row(cache, i, 2, seed=i) for i in range(3)]
    with pytest.raises(ValueError, match="increasing active rows"):
        cache.keep_rows(bad)
    assert cache.batch_size == 3  # unchanged
    for index, kv in enumerate(rows):
        assert_row(cache, index, kv)
