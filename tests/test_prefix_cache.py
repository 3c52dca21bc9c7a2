"""Automatic prefix caching: a row's blocks entered in the cache are shared by a later row whose
prompt starts the same way (the same blocks, no copy); a hit stops at the first block that
differs and always leaves a prompt token to prefill; idle blocks stay within the cache's size,
a sequence's later blocks evicted first; and through the
engine, prompts that repeat or extend earlier ones (a chat's next turn) prefill only what is
new and give the tokens a cold run gives, plain and speculative, alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_eagle3_head

from specdecode.cache.attention_metadata import AttentionMode
from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.cache.prefix_cache import PrefixCache
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SYSTEM = torch.randint(0, 256, (3 * BLOCK_TOKENS + 5,), generator=torch.Generator().manual_seed(0))
SYSTEM = SYSTEM.tolist()  # a shared opening of three blocks and a bit


def _fill(model, cache, token_ids: list[int]) -> int:
    """A new row of `cache` holding `token_ids`' keys and values (a prefill); returns it."""
    from specdecode.cache.attention_metadata import AttentionMetadata

    (row,) = cache.add_rows(1)
    view = cache.row(row)
    meta = AttentionMetadata.prefill([len(token_ids)], "cpu")
    model(torch.tensor([token_ids]), meta, view)
    cache.set_length(row, view.lengths[0])
    return row


def _cache(model_dir: Path):
    """A float32 tiny model and an empty cache of it."""
    model = load_model(model_dir, dtype="float32")
    return model, model.new_cache(0, 0)


def test_blocks_are_shared_and_stop_where_the_prompt_differs(tiny_model_dir: Path) -> None:
    model, cache = _cache(tiny_model_dir)
    source = _fill(model, cache, SYSTEM)
    store = PrefixCache(max_tokens=64 * BLOCK_TOKENS)
    store.store(SYSTEM, cache, source)
    assert store.num_tokens == 3 * BLOCK_TOKENS  # full blocks only
    (row,) = cache.add_rows(1)
    view = cache.row(row)
    held = cache.pool.blocks_in_use
    loaded = store.load([*SYSTEM, 7, 8], view)
    assert loaded == 3 * BLOCK_TOKENS and view.lengths == [loaded]
    cache.set_length(row, loaded)
    assert cache.tables[row] == cache.tables[source][:3]  # the same blocks: nothing copied
    assert cache.pool.blocks_in_use == held
    for got, want in zip(cache.gather(row), cache.gather(source), strict=True):
        assert torch.equal(got, want[:, :, :loaded])
    changed = list(SYSTEM)
    changed[BLOCK_TOKENS + 3] += 1  # the second block differs: only the first is served
    assert store.load(changed, cache.row(cache.add_rows(1)[0])) == BLOCK_TOKENS
    exact = SYSTEM[: 2 * BLOCK_TOKENS]  # two whole blocks: the last token stays to prefill
    assert store.load(exact, cache.row(cache.add_rows(1)[0])) == BLOCK_TOKENS
    assert store.queried_tokens == 2 * len(SYSTEM) + 2 + len(exact)
    assert store.hit_tokens == loaded + BLOCK_TOKENS + BLOCK_TOKENS
    _, other = _cache(tiny_model_dir)  # another pool: the entries of this one do not apply
    assert store.load(SYSTEM, other.row(other.add_rows(1)[0])) == 0


def test_idle_blocks_stay_within_the_size_later_blocks_first(tiny_model_dir: Path) -> None:
    model, cache = _cache(tiny_model_dir)
    store = PrefixCache(max_tokens=4 * BLOCK_TOKENS)
    first = SYSTEM[: 3 * BLOCK_TOKENS]
    store.store(first, cache, _fill(model, cache, first))
    other = [t + 1 for t in first[: 2 * BLOCK_TOKENS]]
    store.store(other, cache, _fill(model, cache, other))
    assert store.num_tokens == 5 * BLOCK_TOKENS  # held by rows: none is idle yet
    cache.keep_rows([])  # both finish: 5 idle blocks > 4, one goes
    assert store.num_tokens == 4 * BLOCK_TOKENS and cache.pool.blocks_in_use == 0
    # the older sequence lost its last block, not its first
    assert store.load([*first, 1], cache.row(cache.add_rows(1)[0])) == 2 * BLOCK_TOKENS
    store.clear()
    assert store.num_tokens == 0 and not cache.pool.idle
    with pytest.raises(ValueError, match="holds no block"):
        PrefixCache(max_tokens=BLOCK_TOKENS - 1)
    with pytest.raises(UserError, match="prefix_cache_tokens must be 0"):
        SchedulerConfig(prefix_cache_tokens=5)


def _llm(model_dir: Path, cached: bool, **kwargs) -> LLM:
    llm = LLM(model=str(model_dir), dtype="float32", **kwargs)
    llm.set_scheduler(SchedulerConfig(prefix_cache_tokens=4096 if cached else 0))
    return llm


@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_hits_give_the_tokens_of_a_cold_run(tiny_model_dir: Path, config) -> None:
    cold = _llm(tiny_model_dir, cached=False, speculative_config=config)
    warm = _llm(tiny_model_dir, cached=True, speculative_config=config)
    turn1 = {"prompt_token_ids": [*SYSTEM, 40, 41, 42]}
    (first,) = warm.generate(turn1, GREEDY)
    assert first.metrics.num_cached_tokens == 0
    assert first.token_ids == cold.generate(turn1, GREEDY)[0].token_ids
    # the next turn: the conversation so far, then a new message
    turn2 = {"prompt_token_ids": [*SYSTEM, 40, 41, 42, *first.token_ids, 50, 51]}
    (second,) = warm.generate(turn2, GREEDY)
    grown = len(SYSTEM) + 3 + len(first.token_ids) - 1  # the row held all but the last token
    assert second.metrics.num_cached_tokens == grown // BLOCK_TOKENS * BLOCK_TOKENS
    assert second.token_ids == cold.generate(turn2, GREEDY)[0].token_ids
    # a batch sharing the system prompt, some hits and some not
    batch = [{"prompt_token_ids": SYSTEM + [60 + i] * (i + 1)} for i in range(3)]
    batch.append({"prompt_token_ids": [9, 8, 7]})
    outs = warm.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold.generate(batch, GREEDY)]
    assert [o.metrics.num_cached_tokens for o in outs] == [3 * BLOCK_TOKENS] * 3 + [0]


def test_a_drafter_that_reads_hidden_states_gets_no_hits(tiny_model_dir: Path) -> None:
    head = build_tiny_eagle3_head(tiny_model_dir, tiny_model_dir / "eagle3_prefix")
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    warm = _llm(tiny_model_dir, cached=True, speculative_config=config)
    prompt = {"prompt_token_ids": [*SYSTEM, 1, 2]}
    (first,) = warm.generate(prompt, GREEDY)
    (again,) = warm.generate(prompt, GREEDY)
    assert again.metrics.num_cached_tokens == 0 and again.token_ids == first.token_ids


@pytest.mark.parametrize("reads_states", [False, True], ids=["kv", "reads_states"])
def test_the_kv_manager_keeps_a_leaving_rows_blocks_for_the_next_prompt(
    tiny_model_dir: Path, reads_states: bool
) -> None:
    """A finished request's full blocks go to the prefix cache as its row is freed, and the
    next prompt that starts the same way starts from them (`KVManager.start`); a preempted
    one's too. Under a drafter that reads the target's states nothing is kept or loaded."""
    from specdecode.cache.attention_metadata import AttentionMetadata
    from specdecode.engine.kv_manager import KVManager
    from specdecode.engine.request import Request

    model = load_model(tiny_model_dir, dtype="float32")
    config = SchedulerConfig(kv_cache_tokens=16 * BLOCK_TOKENS)
    kv = KVManager(model, config, reads_states)
    context = model.config.max_position_embeddings

    def request(name: str, tail: list[int]) -> Request:
        return Request(name, None, [*SYSTEM, *tail], GREEDY, (), context)

    def prefill(req: Request, row: int) -> None:
        assert kv.cache is not None
        left = kv.start(req, row)
        view = kv.cache.row(row)
        done = view.lengths[0]
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [done], [left], "cpu")
        model(torch.tensor([req.prefill_ids[done:]]), meta, view)
        kv.cache.set_length(row, view.lengths[0])

    first, second = request("a", [1, 2]), request("b", [3])
    assert kv.usage() == 0.0
    kv.add_rows(2)
    prefill(first, 0)
    prefill(second, 1)
    assert first.num_cached_tokens == 0 and kv.usage() == 8 / 16  # 3 + 1 blocks each
    first.finish("abort", None)
    assert kv.keep([first, second]) == [1] and kv.usage() == 4 / 16
    third = request("c", [4, 5])
    kv.add_rows(1)
    hit = 0 if reads_states else 3 * BLOCK_TOKENS
    assert kv.start(third, 1) == len(third.prompt_ids) - hit
    assert third.num_cached_tokens == hit
    kv.preempt([third], running=2)  # the newest, the last row, goes back to the queue
    assert kv.cache is not None and kv.cache.batch_size == 1 and kv.usage() == 4 / 16
    assert kv.prefix_cache is not None  # kept under both; filled only where prompts read it
    assert kv.prefix_cache.num_tokens == (0 if reads_states else 3 * BLOCK_TOKENS)
