"""The server against what a probe (as a new user and as an attacker) found: each fault it
reproduced is a test here. Bodies past the size limit are refused before they are read; long
tokenization runs off the event loop; the API key guards every route but the public ones;
a non-streamed request aborts when its client leaves; invalid Unicode, deep nesting and bad
UTF-8 get OpenAI-shaped 400s; xgrammar's compiler keeps no unbounded cache."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_model
from server_cases import metric, running_server

from specdecode.llm import LLM
from specdecode.server.app import ServeConfig

NAME = "tiny"
KEY = "sekrit"
WAIT_S = 60.0
HOLD_S = 10.0  # how long the test tokenizer waits for /health


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("hardening_llama"), "llama")
    return LLM(model=str(model_dir), dtype="float32")


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_a_body_past_the_limit_is_refused_unread(plain: LLM) -> None:
    config = ServeConfig(NAME, max_body_bytes=1 << 20)
    with running_server(plain, config) as base:
        big = json.dumps({"prompt": "x" * (10 << 20)}).encode()
        response = httpx.post(f"{base}/tokenize", content=big, timeout=WAIT_S)
        assert response.status_code == 413
        error = _error(response)
        assert error["code"] == "request_too_large" and str(1 << 20) in error["message"]

        def chunks():  # no Content-Length: the limit counts what arrives
            for _ in range(20):
                yield b"x" * (128 << 10)

        streamed = httpx.post(f"{base}/v1/completions", content=chunks(), timeout=WAIT_S)
        assert streamed.status_code == 413 and _error(streamed)["code"] == "request_too_large"
        assert httpx.get(f"{base}/health").status_code == 200


def _post(url: str, body: dict, statuses: list[int]) -> None:
    statuses.append(httpx.post(url, json=body, timeout=WAIT_S).status_code)


def test_tokenizing_runs_off_the_event_loop(plain: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a prompt is being tokenized, /health answers: the tokenizer here waits until it
    has (on the event loop, it would wait for ever, bounded by HOLD_S, and then fail)."""
    encode = plain.tokenizer.encode
    started, answered = threading.Event(), threading.Event()
    saw: list[bool] = []

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        started.set()
        saw.append(answered.wait(HOLD_S))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(plain.tokenizer, "encode", slow_encode)
    with running_server(plain, ServeConfig(NAME)) as base:
        for route, body in (
            ("/tokenize", {"prompt": "abc"}),
            ("/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 1}),
            (
                "/v1/chat/completions",
                {"model": NAME, "messages": [{"role": "user", "content": "a"}]},
            ),
        ):
            started.clear()
            answered.clear()
            results: list[int] = []
            worker = threading.Thread(target=_post, args=(f"{base}{route}", body, results))
            worker.start()
            assert started.wait(WAIT_S), route
            assert httpx.get(f"{base}/health", timeout=WAIT_S).status_code == 200
            answered.set()
            worker.join(WAIT_S)
            assert results == [200] and saw[-1], route


def test_the_key_guards_every_route_but_the_public_ones(plain: LLM) -> None:
    guarded = {
        ("POST", "/tokenize"): {"prompt": "abc"},
        ("POST", "/detokenize"): {"tokens": [1, 2]},
        ("GET", "/docs"): None,
        ("GET", "/openapi.json"): None,
        ("GET", "/redoc"): None,
        ("GET", "/viz"): None,
        ("GET", "/viz/config"): None,
        ("GET", "/v1/models"): None,
        ("POST", "/v1/completions"): {"model": NAME, "prompt": "abc", "max_tokens": 2},
    }
    basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()
    with running_server(plain, ServeConfig(NAME, api_key=KEY)) as base:
        for (method, path), body in guarded.items():
            refused = httpx.request(method, f"{base}{path}", json=body)
            assert refused.status_code == 401, path
            assert _error(refused)["code"] == "invalid_api_key"
            assert refused.headers["www-authenticate"].startswith("Basic")
            for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"Basic {basic}"):
                answered = httpx.request(
                    method, f"{base}{path}", json=body, headers={"Authorization": header}
                )
                assert answered.status_code == 200, (path, header, answered.text)
            wrong = httpx.request(
                method, f"{base}{path}", json=body, headers={"Authorization": "Bearer sekri"}
            )
            assert wrong.status_code == 401
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{base}{path}").status_code == 200
    opened = ServeConfig(NAME, api_key=KEY, public_paths=("/health", "/metrics", "/tokenize"))
    with running_server(plain, opened) as base:
        assert httpx.post(f"{base}/tokenize", json={"prompt": "abc"}).status_code == 200
        assert httpx.post(f"{base}/detokenize", json={"tokens": [1]}).status_code == 401


def test_a_non_streamed_request_aborts_when_its_client_leaves(plain: LLM) -> None:
    engine = plain.engine
    step = engine.step

    def slow_step():  # a request of 200 tokens then runs for seconds
        time.sleep(0.02)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    try:
        with running_server(plain, ServeConfig(NAME)) as base:

            async def leave() -> None:
                body = {"model": NAME, "prompt": "abc", "max_tokens": 200, "ignore_eos": True}
                async with httpx.AsyncClient(timeout=WAIT_S) as client:
                    call = asyncio.ensure_future(client.post(f"{base}/v1/completions", json=body))
                    deadline = time.monotonic() + WAIT_S
                    while (
                        metric(httpx.get(f"{base}/metrics").text, "specdecode:num_requests_running")
                        < 1
                    ):
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.05)
                    call.cancel()  # the client goes away mid-generation
                    with pytest.raises(asyncio.CancelledError):
                        await call

            asyncio.run(leave())
            deadline = time.monotonic() + WAIT_S
            while True:
                text = httpx.get(f"{base}/metrics").text
                done = metric(text, "specdecode:request_success_total")
                if done:
                    break
                assert time.monotonic() < deadline, "the request never ended"
                time.sleep(0.05)
            assert metric(text, "specdecode:request_success_total", 'finished_reason="abort"') == 1
            assert metric(text, "specdecode:request_success_total", 'finished_reason="length"') == 0
    finally:
        del engine.step


SURROGATE = '"a\\ud800b"'  # JSON for a string holding a lone UTF-16 surrogate


def test_invalid_unicode_nesting_and_utf8_are_openai_shaped_400s(plain: LLM) -> None:
    bodies = {
        "/v1/completions": f'{{"model": "{NAME}", "prompt": {SURROGATE}, "max_tokens": 2}}',
        "/v1/chat/completions": (
            f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": {SURROGATE}}}]}}'
        ),
        "/tokenize": f'{{"prompt": {SURROGATE}}}',
    }
    guided = f'{{"model": "{NAME}", "prompt": "a", "guided_choice": ["x", {SURROGATE}]}}'
    bodies["/v1/completions#guided"] = guided
    headers = {"content-type": "application/json"}
    with running_server(plain, ServeConfig(NAME)) as base:
        for route, body in bodies.items():
            url = f"{base}{route.split('#')[0]}"
            response = httpx.post(url, content=body.encode(), headers=headers)
            assert response.status_code == 400, (route, response.text)
            assert "surrogate" in _error(response)["message"], route
        deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        for bad in (deep, b'{"model": "tiny", "prompt": "\xff\xfe"}', b"\xc3"):
            response = httpx.post(f"{base}/v1/completions", content=bad, headers=headers)
            assert response.status_code == 400, response.text
            assert _error(response)["type"] == "invalid_request_error"
        missing = httpx.get(f"{base}/v1/nothing")
        assert missing.status_code == 404 and _error(missing)["type"] == "not_found_error"
        wrong_method = httpx.get(f"{base}/v1/completions")
        assert wrong_method.status_code == 405 and _error(wrong_method)
        assert httpx.post(
            f"{base}/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2}
        ).is_success


def test_the_grammar_compiler_keeps_no_cache_of_its_own(plain: LLM) -> None:
    """The engine's cache of compiled grammars is bounded (by count); xgrammar's compiler
    must not keep another, unbounded one beside it (it grew ~1.7 MB per distinct schema)."""
    pytest.importorskip("xgrammar")
    from specdecode.sampling_params import StructuredOutputsParams
    from specdecode.structured.grammars import Grammars

    grammars = Grammars(plain.tokenizer, plain.model.config.vocab_size)
    for i in range(5):
        schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"}}}
        grammars.start(StructuredOutputsParams(json=json.dumps(schema)), [0])
    assert grammars.compiler_cache_bytes() == 0


def test_serve_flags_for_the_key_and_the_body_limit() -> None:
    from specdecode.cli import build_parser
    from specdecode.errors import UserError
    from specdecode.server.cli import serve_spec

    parser = build_parser()
    default = serve_spec(parser.parse_args(["serve", "m"]))
    assert default.public_paths == ("/health", "/metrics")
    assert default.max_body_bytes == 4 << 20
    args = parser.parse_args(["serve", "m", "--public-paths", "", "--max-body-mib", "0.5"])
    spec = serve_spec(args)
    assert spec.public_paths == () and spec.max_body_bytes == 1 << 19
    opened = parser.parse_args(["serve", "m", "--public-paths", "/health, /viz"])
    assert serve_spec(opened).public_paths == ("/health", "/viz")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--public-paths", "health"])
    with pytest.raises(UserError, match="--max-body-mib must be positive"):
        serve_spec(parser.parse_args(["serve", "m", "--max-body-mib", "0"]))
