"""`specdecode serve` through a real HTTP server on 127.0.0.1 and the real `openai` client:
outputs equal `LLM.generate`, streaming, usage, errors, metrics, and a bounded load test."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import build_tiny_model
from server_cases import metric, running_server

from specdecode.engine.async_engine import AsyncEngine
from specdecode.engine.engine import Engine
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServeConfig

NAME = "tiny"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = ["hello world hello world hello", "abc abc abc abc", "the cat sat on the mat. the cat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("serve_llama"), "llama")


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32")


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_completions_equal_generate_streamed_and_not(
    plain: LLM, model_dir: Path, spec: dict | None
) -> None:
    expected = [plain.generate(p, _greedy(20))[0] for p in PROMPTS]
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=spec)
    usages = []
    with running_server(llm, ServeConfig(NAME)) as base:
        client = _client(base)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            args = {"model": NAME, "prompt": prompt, "max_tokens": 20, "temperature": 0}
            got = client.completions.create(**args, extra_body={"ignore_eos": True})
            assert got.choices[0].text == want.text
            assert got.choices[0].finish_reason == "length"
            assert got.usage.completion_tokens == 20
            assert got.usage.prompt_tokens == len(want.prompt_token_ids)
            chunks = list(
                client.completions.create(
                    **args,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == want.text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
            spec_usage = chunks[-1].usage.model_extra["speculative_decoding"]
            assert (spec_usage["num_drafts"] > 0) == (spec is not None)
            usages += [got.usage, chunks[-1].usage]
        scraped = httpx.get(f"{base}/metrics").text
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        total = sum(u.model_extra["speculative_decoding"][key] for u in usages)
        assert metric(scraped, f"specdecode:spec_decode_{key}_total") == total
    per_pos = metric(scraped, "specdecode:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == sum(
        u.model_extra["speculative_decoding"]["num_accepted_tokens"] for u in usages
    )
    generated = sum(u.completion_tokens for u in usages)
    assert metric(scraped, "specdecode:generation_tokens_total") == generated


def test_chat_equals_llm_chat_streamed_and_not(plain: LLM, model_dir: Path) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say abc abc abc"},
    ]
    (want,) = plain.chat(messages, _greedy(16))
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=NGRAM)
    with running_server(llm, ServeConfig(NAME)) as base:
        client = _client(base)
        args = {"model": NAME, "messages": messages, "temperature": 0}
        got = client.chat.completions.create(
            **args, max_completion_tokens=16, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].message.content == want.text
        assert got.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(
            **args, max_tokens=16, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_seed_and_sampling_fields(plain: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=12)
    (want,) = plain.generate(PROMPTS[0], params)
    with running_server(plain, ServeConfig(NAME)) as base:
        got = _client(base).completions.create(
            model=NAME,
            prompt=PROMPTS[0],
            max_tokens=12,
            temperature=0.8,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 20},
        )
        assert got.choices[0].text == want.text
        greedy = plain.generate(PROMPTS[1], _greedy(20))[0].text
        stop = greedy[3:5]
        got = _client(base).completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop]
        )
        assert got.choices[0].text == greedy[: greedy.index(stop)]
        assert got.choices[0].finish_reason == "stop"


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_errors_have_openai_shape_and_say_what_is_wrong(plain: LLM) -> None:
    context = plain.model.config.max_position_embeddings
    with running_server(plain, ServeConfig(NAME, api_key="sekrit")) as base:
        auth = {"Authorization": "Bearer sekrit"}
        url = f"{base}/v1/completions"
        ok = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        bad_json = httpx.post(url, content=b'{"model": ', headers=auth)
        assert bad_json.status_code == 400 and "JSON" in _error(bad_json)["message"]
        wrong_key = httpx.post(url, json=ok, headers={"Authorization": "Bearer nope"})
        assert wrong_key.status_code == 401 and _error(wrong_key)["code"] == "invalid_api_key"
        assert httpx.post(url, json=ok).status_code == 401
        unknown = httpx.post(url, json={**ok, "model": "gpt-9"}, headers=auth)
        assert unknown.status_code == 404 and "gpt-9" in _error(unknown)["message"]
        negative = httpx.post(url, json={**ok, "max_tokens": -1}, headers=auth)
        assert negative.status_code == 400 and _error(negative)["param"] == "max_tokens"
        long = httpx.post(url, json={**ok, "prompt": "x" * (context + 5)}, headers=auth)
        assert long.status_code == 400 and str(context) in _error(long)["message"]
        too_many = httpx.post(url, json={**ok, "max_tokens": context}, headers=auth)
        message = _error(too_many)["message"]
        assert (
            too_many.status_code == 400 and str(context) in message and "2 in the prompt" in message
        )
        many = httpx.post(url, json={**ok, "n": 17}, headers=auth)
        assert many.status_code == 400 and _error(many)["param"] == "n"
        best = httpx.post(url, json={**ok, "n": 2, "best_of": 3}, headers=auth)
        assert best.status_code == 400 and _error(best)["param"] == "best_of"
        bias = httpx.post(url, json={**ok, "logit_bias": {"x": 1}}, headers=auth)
        assert bias.status_code == 400 and _error(bias)["param"] == "logit_bias"
        far = httpx.post(url, json={**ok, "logit_bias": {"300": 1}}, headers=auth)
        assert far.status_code == 400 and "outside the vocabulary" in _error(far)["message"]
        echoed = httpx.post(url, json={**ok, "echo": True, "logprobs": 1}, headers=auth)
        assert echoed.status_code == 400 and _error(echoed)["param"] == "echo"
        penalty = httpx.post(url, json={**ok, "presence_penalty": 3}, headers=auth)
        assert penalty.status_code == 400 and _error(penalty)["param"] == "presence_penalty"
        chat_url = f"{base}/v1/chat/completions"
        top = {"model": NAME, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}
        alone = httpx.post(chat_url, json=top, headers=auth)
        assert alone.status_code == 400 and _error(alone)["param"] == "top_logprobs"
        seed = httpx.post(url, json={**ok, "seed": 2**70}, headers=auth)
        assert seed.status_code == 400 and "seed" in _error(seed)["message"]
        temp = httpx.post(url, json={**ok, "temperature": -1}, headers=auth)
        assert temp.status_code == 400 and _error(temp)["param"] == "temperature"
        chat = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME}, headers=auth)
        assert chat.status_code == 400 and _error(chat)["param"] == "messages"
        assert httpx.post(url, json=ok, headers=auth).status_code == 200  # still serving
        with pytest.raises(openai.NotFoundError):
            _client(base, "sekrit").completions.create(model="nope", prompt="hi")


def test_models_health_tokenize_detokenize(plain: LLM) -> None:
    with running_server(plain, ServeConfig(NAME)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        models = _client(base).models.list()
        assert [m.id for m in models.data] == [NAME]
        tokens = httpx.post(f"{base}/tokenize", json={"model": NAME, "prompt": "abc"}).json()
        assert tokens["tokens"] == plain.tokenizer.encode("abc") and tokens["count"] == 3
        text = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert text == {"prompt": "abc"}
        chat = httpx.post(
            f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        ).json()
        want = plain.chat_prompt([{"role": "user", "content": "hi"}])["prompt_token_ids"]
        assert chat["tokens"] == want
        bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400


LOAD_CLIENTS = 64
LOAD_ABORTS = 16
LOAD_TIMEOUT_S = 240
ABORT_PROMPT, ABORT_TOKENS = "a mat and a cat", 200


async def _load(base: str, jobs: list[tuple[str, int, bool]]) -> list[tuple[str, object]]:
    """Run every (prompt, max_tokens, abort) job at once as a streaming client, plus bad
    requests in between; returns (text, usage) per job (usage None when aborted)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)

    async def one(prompt: str, max_tokens: int, abort: bool) -> tuple[str, object]:
        stream = await client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, used, seen = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            used = chunk.usage or used
            seen += 1
            if abort and seen == 2:
                await stream.close()
                return text, None
        return text, used

    async def bad(i: int) -> int:
        async with httpx.AsyncClient() as http:
            body = [
                b'{"model": "tiny", "prompt": ',
                json.dumps({"model": "nope", "prompt": "x", "max_tokens": 2}).encode(),
                json.dumps({"model": NAME, "prompt": "x" * 400, "max_tokens": 2}).encode(),
                json.dumps({"model": NAME, "prompt": "x", "max_tokens": -3}).encode(),
            ][i % 4]
            headers = {"content-type": "application/json"}
            response = await http.post(f"{base}/v1/completions", content=body, headers=headers)
            return response.status_code

    tasks = [one(*job) for job in jobs] + [bad(i) for i in range(8)]
    results = await asyncio.wait_for(asyncio.gather(*tasks), LOAD_TIMEOUT_S)
    assert sorted(results[len(jobs) :]) == [400] * 6 + [404] * 2
    return results[: len(jobs)]


def test_load_nothing_lost_aborts_free_slots_metrics_add_up(plain: LLM, model_dir: Path) -> None:
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "with", "dog"]
    jobs = []
    for i in range(LOAD_CLIENTS):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        if i % (LOAD_CLIENTS // LOAD_ABORTS) == 0:  # long, so it normally runs when closed
            jobs.append((ABORT_PROMPT, ABORT_TOKENS, True))
        else:
            jobs.append((prompt, rng.randint(4, 24), False))
    limits = SchedulerConfig(max_num_seqs=16, kv_cache_tokens=4000)
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=NGRAM, scheduler=limits)
    with running_server(llm, ServeConfig(NAME)) as base:
        results = asyncio.run(_load(base, jobs))
        deadline = time.monotonic() + 30
        while True:
            scraped = httpx.get(f"{base}/metrics").text
            if metric(scraped, "specdecode:num_requests_running") == 0:
                break
            assert time.monotonic() < deadline, "aborted requests kept their slots"
            time.sleep(0.1)
    assert metric(scraped, "specdecode:kv_cache_usage_perc") == 0  # every block came back
    assert f'specdecode:num_preemptions_total{{model_name="{NAME}"}}' in scraped
    completed = [(job, r) for job, r in zip(jobs, results, strict=True) if not job[2]]
    assert len(completed) == LOAD_CLIENTS - LOAD_ABORTS
    for (prompt, max_tokens, _), (text, used) in completed:
        assert text == plain.generate(prompt, _greedy(max_tokens))[0].text
        assert used.completion_tokens == max_tokens
    # An aborting client may close only after its request completed (the client reads late):
    # those count as completed, each with ABORT_TOKENS tokens.
    finished = metric(scraped, "specdecode:request_success_total", 'finished_reason="length"')
    late = int(finished) - len(completed)
    aborted = metric(scraped, "specdecode:request_success_total", 'finished_reason="abort"')
    assert aborted + late == LOAD_ABORTS and aborted >= 1
    usages = [used for _, (_, used) in completed]
    generated = sum(u.completion_tokens for u in usages) + late * ABORT_TOKENS
    assert metric(scraped, "specdecode:generation_tokens_total") == generated
    prompts = sum(u.prompt_tokens for u in usages) + late * len(
        plain.tokenizer.encode(ABORT_PROMPT)
    )
    assert metric(scraped, "specdecode:prompt_tokens_total") == prompts
    assert metric(scraped, "specdecode:time_to_first_token_seconds_count") >= len(completed)


def test_cost_policy_seeds_pass_costs_and_reports_the_draft_limit(
    plain: LLM, model_dir: Path
) -> None:
    spec = {**NGRAM, "draft_length": "cost"}
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=spec)
    engine = Engine(llm.model, llm.tokenizer, llm.engine.drafter, llm.engine.draft_length)
    seconds = engine.warm_up(max_rows=4)
    rows, widths = [1, 2, 4], [1, 2, 3, 5]  # 4 rows of K + 1 = 5 tokens at most
    assert sorted(seconds) == [(r, w) for r in rows for w in widths]
    assert engine.draft_length.passes.seeded.keys() == seconds.keys()
    assert plain.engine.warm_up(4) == {}  # a fixed K needs no costs
    want = plain.generate(PROMPTS[0], _greedy(20))[0].text
    with running_server(llm, ServeConfig(NAME)) as base:
        got = _client(base).completions.create(
            model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        scraped = httpx.get(f"{base}/metrics").text
    assert got.choices[0].text == want
    limit = metric(scraped, "specdecode:spec_decode_draft_limit")
    assert 0 <= limit <= NGRAM["num_speculative_tokens"]


@pytest.mark.real_model
def test_serve_command_on_smollm2_answers_like_llm_chat(smollm2_dir: Path) -> None:
    """`specdecode serve` as users start it (a subprocess, int8, ngram speculation): a chat
    reply through the openai client equals LLM.chat's on the same weights."""
    messages = [{"role": "user", "content": "Repeat exactly: one two three four five six."}]
    llm = LLM(model=str(smollm2_dir), quantization="int8")
    (want,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "specdecode.cli", "serve", str(smollm2_dir), "--port", str(port),
        "--quantization", "int8", "--served-model-name", "smol",
        "--speculative-config", json.dumps(NGRAM), "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        got = _client(base).chat.completions.create(
            model="smol", messages=messages, max_tokens=24, temperature=0
        )
        assert got.choices[0].message.content == want.text
        assert got.usage.model_extra["speculative_decoding"]["num_drafts"] > 0
    finally:
        server.terminate()
        server.wait(30)


def test_engine_thread_survives_a_consumer_whose_loop_closed(plain: LLM) -> None:
    """Events for a request whose asyncio loop is gone abort it (delivering to a closed loop
    raises); the thread keeps serving."""
    engine = Engine(plain.model, plain.tokenizer)
    runner = AsyncEngine(engine)
    try:
        gone = asyncio.new_event_loop()
        request = plain.make_request(PROMPTS[0], _greedy(50), "orphan")
        runner._inbox.put((request, gone, asyncio.Queue()))
        gone.close()
        deadline = time.monotonic() + 30
        # the engine thread aborts the request, then forgets its sink: wait for both
        while not request.finished or "orphan" in runner._sinks:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Aborted at its first delivered event (or finished, if its text was all held back
        # until the end); either way the thread lives on and forgot the request.
        assert runner.alive

        async def one() -> str:
            fresh = plain.make_request(PROMPTS[1], _greedy(8), "fresh")
            return [e async for e in runner.generate(fresh)][-1].output.text

        assert asyncio.run(one()) == plain.generate(PROMPTS[1], _greedy(8))[0].text
    finally:
        runner.shutdown()
