"""Structured output over HTTP with the real `openai` client on 127.0.0.1: OpenAI's
`response_format` (json_schema, json_object), vLLM's `structured_outputs` and `guided_*`, and
400s for bad constraints (before any stream starts); the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from conftest import build_tiny_model
from server_cases import running_server

from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "integer", "minimum": 0}},
    "required": ["name", "born"],
    "additionalProperties": False,
}
MESSAGES = [
    {
        "role": "user",
        "content": "Ada Lovelace was born in 1815. Reply with a JSON object with her name and "
        "the year she was born.",
    }
]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), dtype="float32", speculative_config=NGRAM)


def test_response_format_json_schema_and_json_object(smol: LLM) -> None:
    """SmolLM2 behind the server: json_schema output validates and equals the Python API's
    (streamed and not); json_object output is a JSON object."""
    constraint = {"json": PERSON}
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=constraint)
    want = smol.chat(MESSAGES, params)[0].text
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    args = {"model": "smol", "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
    with running_server(smol, ServeConfig("smol")) as base:
        client = _client(base)
        reply = client.chat.completions.create(**args, response_format=form)
        text = reply.choices[0].message.content
        assert text == want and reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
        chunks = client.chat.completions.create(**args, response_format=form, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        reply = client.chat.completions.create(**args, response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = build_tiny_model(tmp_path_factory.mktemp("structured_server"), "qwen2")
    return LLM(str(model), dtype="float32", speculative_config=NGRAM)


def test_vllm_style_constraints(tiny: LLM) -> None:
    """guided_choice, guided_regex and structured_outputs (extra_body), completions and chat."""
    with running_server(tiny, ServeConfig("tiny")) as base:
        client = _client(base)
        args = {"model": "tiny", "prompt": "pick one", "max_tokens": 40, "temperature": 0}
        out = client.completions.create(**args, extra_body={"guided_choice": ["left", "right"]})
        assert out.choices[0].text in ("left", "right")
        out = client.completions.create(**args, extra_body={"guided_regex": "[0-9]{3}"})
        assert len(out.choices[0].text) == 3 and out.choices[0].text.isdigit()
        word = {"type": "string", "maxLength": 6}
        bounded = {"name": word, "born": {"type": "integer", "maximum": 3000}}
        short = {**PERSON, "properties": bounded}  # a random model's strings never end
        body = {"structured_outputs": {"json": short, "disable_any_whitespace": True}}
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=120, temperature=0, extra_body=body
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content), short)


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            None,
            "invalid json constraint",
        ),
        ({"guided_regex": "(ab"}, None, "invalid regex constraint: .*parenthesis"),
        ({"guided_grammar": "root ::= b"}, None, 'invalid grammar constraint: .*"b"'),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "no field"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"guided_regex": "a", "ignore_eos": True}, None, "ignore_eos cannot be set"),
    ],
)
def test_bad_constraints_are_400s(tiny: LLM, body: dict, param: str | None, message: str) -> None:
    """Each bad constraint is a 400 naming the problem (and the field where one is to blame),
    streamed or not; a good request right after still succeeds."""
    import re

    with running_server(tiny, ServeConfig("tiny")) as base:
        for stream in (False, True):
            request = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": stream, **body}
            reply = httpx.post(f"{base}/v1/completions", json=request, timeout=60)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert re.search(message, error["message"]), error
            if param is not None:
                assert error["param"] == param
        ok = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 4, "guided_regex": "[ab]+"},
            timeout=60,
        )
        assert ok.status_code == 200 and set(ok.json()["choices"][0]["text"]) <= {"a", "b"}
