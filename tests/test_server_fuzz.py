"""The server under generated and sustained input, bounded in count and time: schemathesis
fuzzes every route of its OpenAPI schema (valid and invalid bodies; no answer may be a 5xx),
and a soak of a few hundred mixed requests (streams, aborts, tokenize, bad bodies, structured
output with distinct schemas) must leave the process's memory and open files level."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_model
from server_cases import running_server

from specdecode.llm import LLM
from specdecode.server.app import ServeConfig

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

NAME = "tiny"
FUZZ_EXAMPLES = 25  # per route
SOAK_ROUNDS = 4
SOAK_REQUESTS = 96  # per round, 16 at a time
SOAK_TIMEOUT_S = 300
RSS_GROWTH_MB = 64  # allowed between the second round (after a warm-up) and the last
SETTLE_S = 15  # for the server thread to close the connections a round's client closed
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("fuzz_llama"), "llama")
    return LLM(model=str(model_dir), dtype="float32").with_drafters([NGRAM])


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_generated_request_is_a_server_error(served: LLM, mode: str) -> None:
    """Bodies that fit the schema (positive) and that break it (negative), for every route.
    (schemathesis's own pytest loader does not run under pytest 9: the cases are drawn from
    its Hypothesis strategy here.)"""
    with running_server(served, ServeConfig(NAME)) as base:
        api = schemathesis.openapi.from_url(f"{base}/openapi.json")
        operations = [result.ok() for result in api.get_all_operations()]
        assert len(operations) >= 8  # the routes are all in the schema
        for operation in operations:
            if mode == "negative" and not operation.body:
                continue  # nothing to break in a route without a body

            @given(case=operation.as_strategy(GenerationMode(mode)))
            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def call(case) -> None:
                case.call_and_validate(checks=[not_a_server_error], timeout=60)

            call()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_file_targets() -> list[str]:
    """What each open file descriptor points at (for a failure message)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed between the listing and the read
            continue
    return sorted(targets)


def _settled_open_files(at_most: int | None = None) -> int:
    """The process's open files once the server thread has closed the sockets of the
    connections the client closed (on a busy 2-core machine it may lag the client): polled
    until the count is at most `at_most` (None: until it holds for half a second), or
    SETTLE_S pass. A leak never settles; a lag does."""
    deadline = time.monotonic() + SETTLE_S
    count, held = _open_files(), 0
    while time.monotonic() < deadline:
        if at_most is not None and count <= at_most:
            break
        if at_most is None and held >= 5:
            break
        time.sleep(0.1)
        latest = _open_files()
        held = held + 1 if latest == count else 0
        count = latest
    return count


def _soak_jobs(rng: random.Random, round_index: int) -> list[tuple[str, dict, bool]]:
    """(route, body, leave early) for one round: every kind of request, mixed."""
    jobs: list[tuple[str, dict, bool]] = []
    for i in range(SOAK_REQUESTS):
        kind = i % 8
        prompt = " ".join(rng.choice(["abc", "the", "cat", "mat", "x"]) for _ in range(8))
        base = {"model": NAME, "max_tokens": rng.randint(1, 24), "temperature": 0}
        if kind == 0:
            jobs.append(("/v1/completions", {**base, "prompt": prompt}, False))
        elif kind == 1:
            jobs.append(("/v1/completions", {**base, "prompt": prompt, "stream": True}, False))
        elif kind == 2:  # a stream whose client leaves after its first chunk
            body = {**base, "prompt": prompt, "stream": True, "max_tokens": 64}
            jobs.append(("/v1/completions", {**body, "ignore_eos": True}, True))
        elif kind == 3:
            messages = [{"role": "user", "content": prompt}]
            jobs.append(("/v1/chat/completions", {**base, "messages": messages}, False))
        elif kind == 4:
            jobs.append(("/tokenize", {"prompt": prompt * 20}, False))
        elif kind == 5:  # a schema no request had before: compiled, then cached or evicted
            field = f"f{round_index}_{i}"
            schema = {"type": "object", "properties": {field: {"type": "integer"}}}
            body = {**base, "prompt": prompt, "max_tokens": 8, "guided_json": schema}
            jobs.append(("/v1/completions", body, False))
        elif kind == 6:
            jobs.append(("/v1/completions", {**base, "prompt": "a\ud800"}, False))
        else:
            jobs.append(("/v1/completions", {**base, "max_tokens": -1, "prompt": prompt}, False))
    return jobs


async def _round(base: str, jobs: list[tuple[str, dict, bool]]) -> list[int]:
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def one(route: str, body: dict, leave: bool) -> int:
            async with limit:
                content = json.dumps(body).encode()
                headers = {"content-type": "application/json"}
                if not body.get("stream"):
                    return (await client.post(route, content=content, headers=headers)).status_code
                request = client.build_request("POST", route, content=content, headers=headers)
                response = await client.send(request, stream=True)
                async for _ in response.aiter_lines():
                    if leave:
                        break
                await response.aclose()
                return response.status_code

        tasks = [one(*job) for job in jobs]
        return await asyncio.wait_for(asyncio.gather(*tasks), SOAK_TIMEOUT_S)


def test_a_soak_leaves_memory_and_open_files_level(served: LLM) -> None:
    rng = random.Random(0)
    with running_server(served, ServeConfig(NAME)) as base:
        levels = []
        for round_index in range(SOAK_ROUNDS):
            statuses = asyncio.run(_round(base, _soak_jobs(rng, round_index)))
            assert set(statuses) <= {200, 400}, sorted(set(statuses))
            assert statuses.count(400) == 2 * SOAK_REQUESTS // 8
            levels.append((_rss_mb(), _settled_open_files()))
            assert httpx.get(f"{base}/health").status_code == 200
        # the first round warms lazily made resources up (threads, compiled grammars, pools):
        # after it, memory and open files must stay level
        (rss_first, files_first), (rss_last, _) = levels[1], levels[-1]
        assert rss_last - rss_first < RSS_GROWTH_MB, levels
        files_last = _settled_open_files(at_most=files_first + 2)
        assert files_last <= files_first + 2, (levels, _open_file_targets())
