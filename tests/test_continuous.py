"""Continuous batching: requests join and leave a running batch between steps, and each one's
output is the same as when it runs alone (fp32 tiny models, greedy and seeded sampling)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdecode.cache.block_pool import BLOCK_TOKENS, blocks_for
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.engine.engine import Engine
from specdecode.engine.request import Request
from specdecode.engine.scheduler import SchedulerConfig, kv_need
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

# Prompts of different lengths, some repetitive (so prompt lookup drafts).
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 17, 42, 99],
    list(range(10, 22)) + list(range(10, 16)),
    [7],
    [1, 2, 3, 1, 2, 3, 1, 2],
    [200, 31, 64, 31, 64, 9],
]
MAX_TOKENS = [18, 7, 12, 5, 14]
JOIN_AT = [0, 0, 2, 3, 6]  # the engine step before which each request is added


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


GREEDY = [greedy(n) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def llms(tiny_model_dir: Path, other_draft_dir: Path) -> dict[str, LLM]:
    """Plain decoding, prompt lookup and a draft model (another tiny model: it is often
    rejected, so rollback runs) on one target."""
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    draft = {"model": str(other_draft_dir), "num_speculative_tokens": 3, "draft_length": "fixed"}
    return {
        "plain": plain,
        "ngram": plain.with_speculative_config(ngram),
        "draft": plain.with_speculative_config(draft),
    }


@pytest.fixture(scope="module")
def alone(llms: dict[str, LLM]) -> list[list[int]]:
    """Each prompt's greedy output when it runs by itself (plain decoding)."""
    plain = llms["plain"]
    return [
        list(plain.generate({"prompt_token_ids": p}, sp)[0].token_ids)
        for p, sp in zip(PROMPTS, GREEDY, strict=True)
    ]


def make_requests(
    llm: LLM, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS
) -> list[Request]:
    return [
        llm.make_request({"prompt_token_ids": p}, sp)
        for p, sp in zip(prompts[: len(params)], params, strict=True)
    ]


def run_joining(
    engine: Engine, reqs: list[Request], join_at: list[int], max_running: int | None = None
) -> list[int]:
    """Add request i before step join_at[i] and step until all finish; returns how many
    requests were running (not finished) when each one joined. Checks on every step that a
    finished request has exactly one final event and that at most `max_running` run."""
    finals: dict[str, int] = {}
    busy_at_join = []
    step = 0
    while step <= max(join_at) or engine.has_unfinished():
        for req, at in zip(reqs, join_at, strict=True):
            if at == step:
                busy_at_join.append(sum(not r.finished for r in engine.scheduler.running))
                engine.add(req)
        for event in engine.step():
            if event.output.finished:
                rid = event.request.request_id
                finals[rid] = finals.get(rid, 0) + 1
                assert list(event.output.token_ids) == event.request.output_ids
        if max_running is not None:
            assert engine.num_running <= max_running
        step += 1
        assert step < 500, "the engine does not finish"
    assert finals == {r.request_id: 1 for r in reqs}
    return busy_at_join


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_joining_a_busy_batch_gives_the_alone_output(
    llms: dict[str, LLM], alone: list[list[int]], method: str
) -> None:
    llm = llms[method]
    reqs = make_requests(llm, GREEDY)
    busy = run_joining(llm.engine, reqs, JOIN_AT)
    assert min(busy[2:]) > 0  # the late ones joined running requests
    assert [r.output_ids for r in reqs] == alone
    assert all(r.finish_reason == "length" for r in reqs)
    assert not llm.engine.has_unfinished() and llm.engine.num_running == 0
    if method != "plain":
        assert sum(r.spec.num_draft_tokens for r in reqs) > 0  # it really drafted
    # each method's own alone output is plain's (lossless), so `alone` is the right reference
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[4]}, GREEDY[4])
    assert list(out.token_ids) == alone[4]


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_request_done_at_its_first_token_leaves_others_intact(
    llms: dict[str, LLM], alone: list[list[int]], method: str
) -> None:
    """A one-token request joins with another in the same step and finishes at its prefill:
    its row is dropped mid-step and the row admitted after it moves down over it."""
    llm = llms[method]
    params = [GREEDY[0], greedy(1), GREEDY[2], GREEDY[4]]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    reqs = make_requests(llm, params, prompts)
    run_joining(llm.engine, reqs, [0, 2, 2, 4])
    assert reqs[1].output_ids == alone[1][:1]
    assert [reqs[i].output_ids for i in (0, 2, 3)] == [alone[0], alone[2], alone[4]]


def test_abort_running_and_waiting_requests(llms: dict[str, LLM], alone: list[list[int]]) -> None:
    llm = llms["ngram"]
    engine = llm.engine
    reqs = make_requests(llm, GREEDY[:3])
    for req in reqs:
        engine.add(req)
    engine.step()  # prefill + one step: at most 1 + 4 tokens each
    assert engine.num_running == 3 and not any(r.finished for r in reqs)
    victim = reqs[1]
    produced = list(victim.output_ids)
    assert engine.abort(victim.request_id) is True
    assert victim.finish_reason == "abort"
    events = engine.step()
    assert engine.num_running == 2 and engine.kv.cache.batch_size == 2  # its row left
    assert victim not in engine.scheduler.running
    assert all(e.request is not victim for e in events)
    assert victim.output_ids == produced  # nothing more was generated for it
    assert engine.abort(victim.request_id) is False  # released: no longer in flight
    # A waiting request (added, no step yet) leaves the queue.
    waiting = llm.make_request({"prompt_token_ids": PROMPTS[3]}, GREEDY[3])
    engine.add(waiting)
    assert engine.num_waiting == 1
    assert engine.abort(waiting.request_id) is True
    assert engine.num_waiting == 0 and waiting.finish_reason == "abort"
    assert waiting.output_ids == []
    assert engine.abort("no-such-request") is False
    while engine.has_unfinished():
        for event in engine.step():
            assert event.request is not waiting
    assert reqs[0].output_ids == alone[0]
    assert reqs[2].output_ids == alone[2]
    # The ids are free again: a new request may reuse them.
    again = Request(
        victim.request_id, None, PROMPTS[1], GREEDY[1], (), llm.model.config.max_position_embeddings
    )
    assert [e.output.finished for e in engine.stream([again])][-1]
    assert again.output_ids == alone[1]


LONG_PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(30 + i)] for i in range(4)]


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cached", "uncached"])
def test_preemption_gives_the_tokens_of_an_uninterrupted_run(
    llms: dict[str, LLM], method: str, prefix_cache: bool
) -> None:
    """A KV cache that holds the four requests as they start but not as they grow: the newest
    are preempted (their rows freed) and resumed later; every request's tokens, greedy and
    seeded sampled, are those it gets with room to spare."""
    llm = llms[method]
    params = [greedy(40), greedy(40)]
    params += [
        SamplingParams(temperature=0.8, seed=s, max_tokens=40, ignore_eos=True) for s in (1, 2)
    ]
    reqs = make_requests(llm, params, LONG_PROMPTS)
    limit = max(blocks_for(kv_need(r)) for r in reqs) * BLOCK_TOKENS  # each fits alone
    config = SchedulerConfig(kv_cache_tokens=limit, prefix_cache_tokens=256 if prefix_cache else 0)
    engine = Engine(
        llm.model, llm.tokenizer, llm.engine.drafter, llm.engine.draft_length, scheduler=config
    )
    for req in reqs:
        engine.add(req)
    most, limits = 0, set()
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()  # what a server's gauges show
        running = {r.request_id for r in engine.scheduler.running}
        assert stats.running_ids == running and stats.running == engine.num_running
        assert stats.waiting == engine.num_waiting and stats.running + stats.waiting <= 4
        assert stats.num_preemptions == engine.num_preemptions
        assert stats.draft_limit in ((0, 3) if method != "plain" else (0,))  # a fixed K
        limits.add(stats.draft_limit)
        most = max(most, stats.running)
        if engine.kv.cache is not None:  # the rows hold no more than the limit
            assert engine.kv.cache.num_blocks * BLOCK_TOKENS <= limit
            assert 0 < stats.kv_cache_usage <= 1 or not stats.running
    assert most >= 3 and any(r.num_preemptions for r in reqs)
    assert (3 in limits) == (method != "plain")
    assert engine.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert engine.stats().kv_cache_usage == 0  # every row left
    if prefix_cache:  # a resumed request's committed blocks came back from the cache
        assert engine.kv.prefix_cache.hit_tokens >= BLOCK_TOKENS
    roomy = make_requests(llm, params, LONG_PROMPTS)
    for req in roomy:
        llm.engine.add(req)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.output_ids for r in reqs] == [r.output_ids for r in roomy]
    assert not any(r.num_preemptions for r in roomy)


def test_kv_cache_limit_refuses_a_request_that_never_fits(llms: dict[str, LLM]) -> None:
    llm = llms["plain"]
    (req,) = make_requests(llm, GREEDY[:1])
    engine = Engine(llm.model, llm.tokenizer, scheduler=SchedulerConfig(kv_cache_tokens=50))
    for refuse in (engine.check, engine.add):  # a server checks first, before any stream
        with pytest.raises(UserError, match=rf"needs {kv_need(req)} KV cache slots.*holds 50"):
            refuse(req)
    assert not engine.has_unfinished()
    assert engine.abort(req.request_id) is False  # its id was never taken
    # what a request could generate alone: nothing here (its drafts' slots alone exceed 50);
    # in a cache of 170 slots (10 whole blocks), the blocks' slots less its prompt and its
    # drafts' slots; the context less its prompt without a limit
    assert engine.room(len(PROMPTS[0])) == 0
    roomy = Engine(llm.model, llm.tokenizer, scheduler=SchedulerConfig(kv_cache_tokens=170))
    room = 10 * BLOCK_TOKENS - len(PROMPTS[0]) - MAX_SPECULATIVE_TOKENS
    assert roomy.room(len(PROMPTS[0])) == room > 0
    context = llm.model.config.max_position_embeddings
    assert llm.engine.room(len(PROMPTS[0])) == context - len(PROMPTS[0])
    roomy.check(make_requests(llm, [greedy(room)])[0])  # the most room() allows fits
    with pytest.raises(UserError, match="KV cache slots"):
        roomy.check(make_requests(llm, [greedy(room + 1)])[0])


@pytest.mark.parametrize("method", ["plain", "draft"])
def test_one_request_at_a_time(llms: dict[str, LLM], alone: list[list[int]], method: str) -> None:
    llm = llms[method]
    engine = Engine(
        llm.model,
        llm.tokenizer,
        llm.engine.drafter,
        llm.engine.draft_length,
        scheduler=SchedulerConfig(max_num_seqs=1),
    )
    reqs = make_requests(llm, GREEDY)
    order = []
    for event in engine.stream(reqs):
        assert engine.num_running <= 1
        if event.output.finished:
            order.append(event.request)
    assert order == reqs  # first come, first served
    assert [r.output_ids for r in reqs] == alone


def test_stream_closed_early_aborts_the_rest(llms: dict[str, LLM], alone: list[list[int]]) -> None:
    llm = llms["plain"]
    engine = llm.engine
    reqs = make_requests(llm, GREEDY)
    events = engine.stream(reqs)
    for _ in events:
        break
    events.close()
    assert not engine.has_unfinished()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert all(r.finish_reason == "abort" for r in reqs)
    assert engine.abort(reqs[0].request_id) is False  # released
    # The engine is usable afterwards and gives the alone output.
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY[0])
    assert list(out.token_ids) == alone[0]


def test_stream_closed_early_leaves_other_requests_running(
    llms: dict[str, LLM], alone: list[list[int]]
) -> None:
    llm = llms["ngram"]
    engine = llm.engine
    other, *mine = make_requests(llm, GREEDY)
    engine.add(other)
    events = engine.stream(mine)
    next(events)
    events.close()
    # One step ran: at most 1 + 4 tokens each, so only the 5-token request may have finished.
    assert all(r.finish_reason in ("abort", "length") for r in mine)
    assert sum(r.finish_reason == "abort" for r in mine) >= 3
    assert not other.finished and engine.has_unfinished()
    assert engine.num_running == 1 and engine.num_waiting == 0
    while engine.has_unfinished():
        engine.step()
    assert other.output_ids == alone[0]


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_seeded_sampling_alone_equals_joining_a_busy_batch(
    llms: dict[str, LLM], method: str
) -> None:
    llm = llms[method]
    seeded = SamplingParams(temperature=0.9, top_k=40, max_tokens=14, seed=11, ignore_eos=True)
    (want,) = llm.generate({"prompt_token_ids": PROMPTS[3]}, seeded)
    (other_seed,) = llm.generate(
        {"prompt_token_ids": PROMPTS[3]},
        SamplingParams(temperature=0.9, top_k=40, max_tokens=14, seed=12, ignore_eos=True),
    )
    assert other_seed.token_ids != want.token_ids  # the seed matters (the test can fail)
    params = [
        SamplingParams(temperature=1.0, max_tokens=16, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True),  # unseeded
        greedy(10),
        seeded,
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[3]]
    reqs = make_requests(llm, params, prompts)
    busy = run_joining(llm.engine, reqs, [0, 0, 1, 3])
    assert busy[3] > 0
    assert tuple(reqs[3].output_ids) == want.token_ids
    (first_alone,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params[0])
    assert tuple(reqs[0].output_ids) == first_alone.token_ids
