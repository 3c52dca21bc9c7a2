"""Step events, per-request drafters and K over HTTP (the real `openai` client and httpx on
127.0.0.1), and the visualizer's routes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from conftest import build_tiny_model
from server_cases import running_server

from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServeConfig

NAME = "tiny"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPT = "abc abc abc abc abc"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("steps_llama"), "llama")


@pytest.fixture(scope="module")
def served(model_dir: Path) -> LLM:
    """ngram (the default) and a draft model (the target itself) behind one server."""
    plain = LLM(model=str(model_dir), dtype="float32")
    draft = {"name": "self", "model": str(model_dir), "num_speculative_tokens": 2}
    return plain.with_drafters([NGRAM, draft])


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def _args(**extra: object) -> dict:
    body = {"ignore_eos": True, "step_events": True, **extra}
    return {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "extra_body": body}


def test_step_events_streamed_and_not_match_the_python_api(served: LLM) -> None:
    (want,) = served.generate(PROMPT, replace(GREEDY, step_events=True))
    tokens = [list(s.tokens) for s in want.outputs[0].steps]
    with running_server(served, ServeConfig(NAME)) as base:
        client = _client(base)
        whole = client.completions.create(**_args())
        events = whole.model_extra["step_events"]
        assert [e["tokens"] for e in events] == tokens
        used = whole.usage.model_extra["energy"]
        assert used["cpu_s"] > 0 and used["joules_estimate"] > 0 and "estimate" in used["method"]
        assert whole.choices[0].text == want.text == "".join(p for e in events for p in e["pieces"])
        chunks = list(client.completions.create(**_args(), stream=True))
        streamed = [e for c in chunks for e in (c.model_extra.get("step_events") or [])]
        assert [e["tokens"] for e in streamed] == tokens
        assert [e["index"] for e in streamed] == list(range(len(tokens)))
        for event in streamed:
            assert len(event["drafted_pieces"]) == len(event["drafted"])
            assert event["final"] in ("sampled", "bonus", "correction")
        assert any(e["num_accepted"] > 0 for e in streamed)
        quiet = client.completions.create(**_args(step_events=False))
        assert "step_events" not in quiet.model_extra
        assert quiet.choices[0].text == want.text


def test_each_request_picks_its_drafter_and_k(served: LLM, model_dir: Path) -> None:
    (want,) = LLM(model=str(model_dir), dtype="float32").generate(PROMPT, GREEDY)
    with running_server(served, ServeConfig(NAME)) as base:
        client = _client(base)
        for drafter, k, most in [
            (None, None, 4),  # the default: ngram, K = 4 (it drafts where it finds a match)
            ("ngram", 1, 1),
            ("self", None, 2),  # the target drafting for itself always drafts its K
            ("self", 1, 1),
            ("self", 0, 0),
        ]:
            got = client.completions.create(**_args(drafter=drafter, num_speculative_tokens=k))
            assert got.choices[0].text == want.text
            longest = max(len(e["drafted"]) for e in got.model_extra["step_events"])
            assert longest == most if drafter == "self" else 1 <= longest <= most
        config = httpx.get(f"{base}/viz/config").json()
        assert config["model"] == NAME
        assert config["drafters"] == [
            {"name": "ngram", "num_speculative_tokens": 4},
            {"name": "self", "num_speculative_tokens": 2},
        ]
        url = f"{base}/v1/completions"
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4}
        unknown = httpx.post(url, json={**body, "drafter": "eagle"})
        assert unknown.status_code == 400
        assert "'eagle'" in unknown.json()["error"]["message"]
        assert "ngram" in unknown.json()["error"]["message"]
        for bad in (-1, 65, "many"):
            refused = httpx.post(url, json={**body, "num_speculative_tokens": bad})
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "num_speculative_tokens"
        assert httpx.post(url, json=body).status_code == 200  # still serving


def test_the_page_and_its_files_are_served_from_the_package(served: LLM) -> None:
    with running_server(served, ServeConfig(NAME)) as base:
        page = httpx.get(f"{base}/viz")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/viz/viz.js">' in page.text and "http" not in page.text.lower()
        script = httpx.get(f"{base}/viz/viz.js")
        assert script.status_code == 200 and "step_events" in script.text
        assert "javascript" in script.headers["content-type"]
        assert httpx.get(f"{base}/viz/viz.css").status_code == 200


def test_a_drafter_name_needs_an_engine_that_serves_names(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=NGRAM)
    with pytest.raises(UserError, match="one drafter and no names"):
        llm.generate(PROMPT, replace(GREEDY, drafter="ngram"))
    with pytest.raises(UserError, match="taken"):
        llm.with_drafters([NGRAM, NGRAM])
    cost = {**NGRAM, "name": "cost", "draft_length": "cost"}
    with pytest.raises(UserError, match="fixed"):
        llm.with_drafters([NGRAM, cost])
