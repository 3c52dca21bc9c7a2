"""Tool calling over HTTP with the real `openai` client on 127.0.0.1: forced calls (required, a
named function) whole and streamed, calls read out of free text ("auto", hermes), a history of
calls and results, and 400s that name the field (tools a model cannot render, OpenAI fields we
do not serve); the tiny model's template renders tools like Qwen2.5's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_cases import running_server
from tool_cases import FORECAST, MESSAGES, TOOLS

from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
FORECAST_CHOICE = {"type": "function", "function": {"name": "forecast"}}
ARGS = {"model": "m", "messages": MESSAGES, "max_tokens": 96, "temperature": 0, "tools": TOOLS}
# A reply written as Qwen2.5 writes a call (forced by a regex, so the random model writes it).
HERMES_REPLY = 'Checking\\.\\n<tool_call>\\n\\{"name": "now", "arguments": \\{\\}\\}\\n</tool_call>'


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(client: openai.OpenAI, **args: object) -> tuple[str, list[dict], str | None]:
    """A streamed reply's content, its calls put together by index, and its finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.fixture(scope="module")
def served(tools_model: Path):
    llm = LLM(str(tools_model), dtype="float32", speculative_config=NGRAM)
    with running_server(llm, ServeConfig("m")) as base:
        yield llm, base


def test_forced_calls_whole_and_streamed(served) -> None:
    llm, base = served
    params = SamplingParams(temperature=0.0, max_tokens=96)
    (want,) = llm.chat(MESSAGES, params, tools=TOOLS, tool_choice=FORECAST_CHOICE)
    client = _client(base)
    reply = client.chat.completions.create(**ARGS, tool_choice=FORECAST_CHOICE)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "forecast"
    assert call.function.arguments == want.outputs[0].tool_calls[0].arguments
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)
    content, calls, reason = _streamed(client, **ARGS, tool_choice=FORECAST_CHOICE)
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("forecast", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    required = client.chat.completions.create(**ARGS, tool_choice="required")
    names = [c.function.name for c in required.choices[0].message.tool_calls]
    assert names and set(names) <= {"forecast", "now"}


def test_calls_in_free_text_are_read_out_of_it(served) -> None:
    """tool_choice "auto": the model's own `<tool_call>` block becomes a call, the text before
    it the content, whole and streamed."""
    _, base = served
    client = _client(base)
    forced = {**ARGS, "extra_body": {"guided_regex": HERMES_REPLY}}
    reply = client.chat.completions.create(**forced)
    message = reply.choices[0].message
    assert message.content == "Checking.\n" and reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("now", "{}")]
    content, calls, reason = _streamed(client, **forced)
    assert content == "Checking.\n" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("now", "{}")]
    none = client.chat.completions.create(**forced, tool_choice="none")  # nothing read
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content.startswith("Checking.\n<tool_call>")


def test_langchain_and_litellm_get_the_calls(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Agent libraries as people use them: langchain's `bind_tools` and litellm's
    `completion`, each forcing the forecast call, read it as the Python API wrote it."""
    llm, base = served
    params = SamplingParams(temperature=0.0, max_tokens=96)
    (want,) = llm.chat(MESSAGES, params, tools=TOOLS, tool_choice=FORECAST_CHOICE)
    arguments = json.loads(want.outputs[0].tool_calls[0].arguments)
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="m", base_url=f"{base}/v1", api_key="none", temperature=0, max_tokens=96
    )
    answer = chat.bind_tools(TOOLS, tool_choice="forecast").invoke(MESSAGES[0]["content"])
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("forecast", arguments)]
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    reply = litellm.completion(
        model="openai/m", api_base=f"{base}/v1", api_key="none", messages=MESSAGES,
        tools=TOOLS, tool_choice=FORECAST_CHOICE, temperature=0, max_tokens=96,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "forecast" and json.loads(call.function.arguments) == arguments


def test_a_history_of_calls_and_results_is_rendered(served) -> None:
    _, base = served
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"unit": "celsius", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain on Tuesday"},
    ]
    reply = _client(base).chat.completions.create(**{**ARGS, "messages": history, "max_tokens": 4})
    assert reply.usage.prompt_tokens > len(json.dumps(TOOLS))  # tools and the history in bytes


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "lack"),
        ({"tools": [{"type": "web"}]}, "tools", "only function tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "constrains the output itself",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"function_call": "auto"}, "function_call", "use tool_choice"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
        ({"modalities": ["text", "audio"]}, "modalities", "only the"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_its_field(
    served, extra: dict, param: str, message: str
) -> None:
    _, base = served
    body = {**ARGS, **extra}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_model_whose_template_renders_no_tools_says_so(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32")
    with running_server(llm, ServeConfig("m")) as base:
        reply = httpx.post(f"{base}/v1/chat/completions", json=ARGS, timeout=60)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert (
            error["param"] == "tools" and "chat template does not render tools" in error["message"]
        )
        plain = httpx.post(f"{base}/v1/chat/completions", json={**ARGS, "tools": None}, timeout=60)
        assert plain.status_code == 200  # and the server goes on
