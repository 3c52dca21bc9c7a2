"""`specdecode serve --replicas 2` on a real local Ray instance (loopback only, a tiny model):
requests are spread over both replicas and answer as one server does, and a replica killed
mid-run is restarted by Ray while the requests on the other replica finish intact."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_model

from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.guard import REPLICA_HEADER
from specdecode.server.ray_serve import APP_NAME, DEPLOYMENT_NAME, check_replicas, start
from specdecode.server.spec import ServeSpec

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'ray[serve]'")
serve = pytest.importorskip("ray.serve")

NAME = "tiny"
PROMPTS = [f"abc abc {i} abc abc {i}" for i in range(8)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
TIMEOUT_S = 120  # every wait below is bounded
ROUTING_BURSTS = 5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ray_llama"), "llama")


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Iterator[str]:
    """Two replicas, one thread each, behind Serve's proxy on 127.0.0.1."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_SERVE_PROXY_HOST": "127.0.0.1"}},
    )
    port = _free_port()
    spec = ServeSpec(
        model=str(model_dir),
        dtype="float32",
        speculative_configs=(NGRAM,),
        max_num_seqs=4,
        kv_cache_gib=0.05,
        served_model_name=NAME,
    )
    try:
        start(spec, 2, "127.0.0.1", port, 1)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _expected(model_dir: Path, max_tokens: int) -> list[str]:
    llm = LLM(model=str(model_dir), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params)]


def _concurrently(fn, items: list) -> list:
    results: list = [None] * len(items)

    def run(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except Exception as error:  # a request that failed: kept as its error
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return results


def test_requests_spread_over_replicas_answer_like_one_server(base: str, model_dir: Path) -> None:
    want = _expected(model_dir, 16)

    def complete(prompt: str) -> tuple[str, str]:
        reply = httpx.post(f"{base}/v1/completions", json=_body(prompt, 16), timeout=TIMEOUT_S)
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"], reply.headers[REPLICA_HEADER]

    # Serve's router picks between two random replicas by their queues, so one burst can land on
    # one replica (seen once in CI); a bounded number of bursts must reach both.
    served: set[str] = set()
    for _ in range(ROUTING_BURSTS):
        got = _concurrently(complete, PROMPTS)
        assert [g[0] for g in got] == want
        served |= {g[1] for g in got}
        if len(served) == 2:
            break
    assert len(served) == 2, f"{ROUTING_BURSTS} bursts of {len(PROMPTS)} all reached {served}"
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == NAME


def test_a_killed_replica_is_restarted_and_the_other_loses_nothing(
    base: str, model_dir: Path
) -> None:
    max_tokens = 200
    want = dict(zip(PROMPTS, _expected(model_dir, max_tokens), strict=True))
    started: dict[str, str] = {}  # prompt -> replica, once its stream is open
    ready = threading.Event()

    def stream(prompt: str) -> str:
        text = ""
        body = _body(prompt, max_tokens, stream=True)
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            started[prompt] = r.headers[REPLICA_HEADER]
            if len(started) == len(PROMPTS):
                ready.set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        return text

    results: dict[str, object] = {}
    runner = threading.Thread(
        target=lambda: results.update(zip(PROMPTS, _concurrently(stream, PROMPTS), strict=True))
    )
    runner.start()
    assert ready.wait(TIMEOUT_S), "not every stream opened"
    victim = next(iter(started.values()))
    actors = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    assert actors.replica_states.get("RUNNING") == 2
    handle = next(
        ray.get_actor(a["name"], namespace="serve")
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].endswith(victim)
    )
    ray.kill(handle, no_restart=False)
    runner.join(TIMEOUT_S)
    survivors = [p for p, replica in started.items() if replica != victim]
    victims = [p for p, replica in started.items() if replica == victim]
    assert any(isinstance(results[p], httpx.HTTPError) for p in victims), "killed too late"
    assert survivors, "every request went to one replica"
    for prompt in survivors:  # nothing that was not on the killed replica is lost
        assert results[prompt] == want[prompt]
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        state = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
        if state.replica_states.get("RUNNING") == 2:
            break
        time.sleep(1)
    else:
        pytest.fail("Ray did not restart the killed replica")
    replies = _concurrently(
        lambda p: httpx.post(f"{base}/v1/completions", json=_body(p, 16), timeout=TIMEOUT_S),
        PROMPTS,
    )
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in replies)
    assert victim not in {r.headers[REPLICA_HEADER] for r in replies}  # a new replica


def test_bad_replica_counts_are_refused() -> None:
    with pytest.raises(UserError, match="--replicas must be >= 1"):
        check_replicas(0, None)
    with pytest.raises(UserError, match="--threads-per-replica must be >= 1"):
        check_replicas(2, 0)
    assert check_replicas(4, 3) == 3
