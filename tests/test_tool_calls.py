"""Tool calling in the Python API: the tools and tool_choice a chat takes (clear errors for bad
ones), the parsers that read calls out of each family's format (whole and as a stream), and
`LLM.chat(..., tools=...)` on tiny models with a tools-rendering chat template, constrained
("required", a named function) and exact under every drafter."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from drafter_examples import example_config
from tool_cases import FORECAST, MESSAGES, TOOLS, TOOLS_TEMPLATE

from specdecode.commands.chat import ChatSession
from specdecode.corpus.prompts import load_prompts
from specdecode.drafters.registry import DRAFTERS
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.registry import is_pulled
from specdecode.sampling_params import SamplingParams
from specdecode.tool_calls.parsers import (
    ArgumentsParser,
    CallArrayParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Parsed,
    parser_name,
)
from specdecode.tool_calls.request import tool_request
from specdecode.tool_calls.tools import parse_tool_choice, parse_tools, template_messages
from specdecode.types import ToolCall


def test_hermes_calls_and_the_text_around_them() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "forecast", "arguments": {"unit": "celsius", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    parsed = HermesParser().parse(text, final=True)
    assert parsed.content == "Let me check.\n\n"
    assert parsed.calls == (
        ToolCall("forecast", '{"unit": "celsius", "days": 3}'),
        ToolCall("now", "{}"),
    )
    broken = "<tool_call>\n{not json}\n</tool_call> and an open <tool_call>{"
    assert HermesParser().parse(broken, final=True).content == broken  # nothing lost
    assert HermesParser().parse(broken, final=True).calls == ()


@pytest.mark.parametrize(
    "parser, text",
    [
        (HermesParser(), 'Sure: <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call> ok'),
        (HermesParser(), "a < b, and <tool_ is not <tool_call> closed"),
        (HermesParser(frozenset({"now"})), '```json\n{"name": "now", "arguments": {}}\n```'),
        (HermesParser(frozenset({"now"})), '{"name": "later", "arguments": {}}'),
        (HermesParser(frozenset({"now"})), "```python\nprint(1)\n```"),
        (Llama3JsonParser(), '<|python_tag|>{"name": "now", "parameters": {"a": 1}}'),
        (Llama3JsonParser(), "The answer is {1, 2}."),
        (MistralParser(), 'Here [TOOL_CALLS][{"name": "now", "arguments": {}}]'),
        (CallArrayParser(), '[{"name": "now", "arguments": {}}]'),
        (ArgumentsParser("forecast"), '{"unit": "celsius", "days": 2}'),
    ],
)
def test_a_stream_sends_content_that_stays_and_no_call_early(parser, text: str) -> None:
    """At every cut of the text, the streamed content is a prefix of the final content, and
    no call is read before the text that holds it is complete."""
    final = parser.parse(text, final=True)
    for cut in range(len(text) + 1):
        partial = parser.parse(text[:cut], final=False)
        assert final.content.startswith(partial.content), (cut, partial.content)
        assert final.calls[: len(partial.calls)] == partial.calls


def test_a_call_without_its_tags_is_read_only_when_it_is_the_whole_answer() -> None:
    """Small models often answer with the call's JSON alone (bare or fenced): read as a call
    of an offered function; another name, or JSON inside other text, stays content."""
    hermes = HermesParser(frozenset({"now", "forecast"}))
    call = '{"name": "forecast", "arguments": {"days": 2}}'
    assert hermes.parse(f"\n```json\n{call}\n```", True) == Parsed(
        "", (ToolCall("forecast", '{"days": 2}'),)
    )
    assert hermes.parse(call, True).calls == (ToolCall("forecast", '{"days": 2}'),)
    unknown = '{"name": "rm", "arguments": {}}'
    assert hermes.parse(unknown, True) == Parsed(unknown)
    assert hermes.parse(f"Here: {call}", True) == Parsed(f"Here: {call}")
    assert HermesParser().parse(call, True) == Parsed(call)  # no names offered: no guessing


def test_llama3_mistral_and_the_constrained_formats() -> None:
    two = '{"name": "now", "parameters": {}}; {"name": "forecast", "parameters": {"days": 1}}'
    assert [c.name for c in Llama3JsonParser().parse(two, final=True).calls] == ["now", "forecast"]
    assert Llama3JsonParser().parse("It is {warm}", final=True).content == "It is {warm}"
    mistral = MistralParser().parse('Hi[TOOL_CALLS][{"name": "now", "arguments": {}}]', True)
    assert mistral.content == "Hi" and mistral.calls == (ToolCall("now", "{}"),)
    array = CallArrayParser().parse('[{"name": "now", "arguments": {"x": "é"}}]', True)
    assert array.calls == (ToolCall("now", '{"x": "é"}'),)
    assert ArgumentsParser("now").parse('{"a": [1]}', True).calls == (
        ToolCall("now", '{"a": [1]}'),
    )
    cut = ArgumentsParser("now").parse('{"a": [1', True)  # cut by max_tokens: left as text
    assert cut.calls == () and cut.content == '{"a": [1'


def test_the_parser_is_the_templates_or_the_one_named() -> None:
    assert parser_name(TOOLS_TEMPLATE) == "hermes"
    assert parser_name("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_name("<|python_tag|> ipython") == "llama3_json"
    assert parser_name("{{ tools }}") is None
    assert parser_name(None, "mistral") == "mistral"
    with pytest.raises(UserError, match="unknown tool-call parser 'xml'; known: hermes"):
        parser_name(TOOLS_TEMPLATE, "xml")


@pytest.mark.parametrize(
    "tools, message",
    [
        ([], "non-empty list"),
        (
            [{"type": "retrieval"}],
            r"tools\[0\]: only function tools are supported, got 'retrieval'",
        ),
        ([{"type": "function"}], r"tools\[0\] needs a 'function' object"),
        ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
        ([TOOLS[1], TOOLS[1]], r"tools\[1\]: the function name 'now' is given twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "must be a JSON schema of an object",
        ),
    ],
)
def test_bad_tools_are_named(tools: list, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_tools(tools)


def test_tool_choice_and_what_it_needs() -> None:
    tools = parse_tools(TOOLS)
    assert parse_tool_choice(None, tools).mode == "auto"
    named = parse_tool_choice({"type": "function", "function": {"name": "now"}}, tools)
    assert (named.mode, named.name) == ("named", "now")
    with pytest.raises(UserError, match="names the function 'later', which tools lack"):
        parse_tool_choice({"type": "function", "function": {"name": "later"}}, tools)
    with pytest.raises(UserError, match="tool_choice must be"):
        parse_tool_choice("always", tools)
    with pytest.raises(UserError, match="tool_choice 'required' needs tools"):
        tool_request(None, "required", True, TOOLS_TEMPLATE, "m")
    with pytest.raises(UserError, match="m's chat template does not render tools"):
        tool_request(TOOLS, "auto", True, "{{ messages }}", "m")
    with pytest.raises(UserError, match="shows no tool-call format we read"):
        tool_request(TOOLS, "auto", True, "{{ tools }}", "m")
    assert tool_request(TOOLS, "required", True, "{{ tools }}", "m") is not None  # no parser
    one = tool_request(TOOLS, "required", False, TOOLS_TEMPLATE, "m")
    assert one is not None and json.loads(one.constraint().json)["maxItems"] == 1


def test_past_calls_reach_the_template_as_objects() -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    shaped = template_messages(history)
    assert shaped[1]["content"] == "" and shaped[1]["tool_calls"][0]["function"]["arguments"] == {}
    history[1]["tool_calls"][0]["function"]["arguments"] = "{oops"
    with pytest.raises(UserError, match=r"messages\[1\].tool_calls: the arguments of 'now'"):
        template_messages(history)


def _calls(llm: LLM, choice: object) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=96)
    (out,) = llm.chat(MESSAGES, params, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    return [out.outputs[0].finish_reason, out.text, list(out.outputs[0].tool_calls)]


def test_forced_calls_parse_and_validate(tools_model: Path) -> None:
    llm = LLM(str(tools_model), dtype="float32")
    prompt = llm.chat_prompt(MESSAGES, llm.tool_request(TOOLS))["prompt_token_ids"]
    assert '"name": "forecast"' in llm.tokenizer.decode(prompt)  # the template saw the tools
    reason, _, calls = _calls(llm, "required")
    assert reason == "stop" and len(calls) == 1 and calls[0].name in ("forecast", "now")
    reason, text, calls = _calls(llm, {"type": "function", "function": {"name": "forecast"}})
    assert reason == "stop" and [c.name for c in calls] == ["forecast"]
    jsonschema.validate(json.loads(calls[0].arguments), FORECAST)
    assert json.loads(text) == json.loads(calls[0].arguments)
    reason, text, calls = _calls(llm, "auto")  # the random model writes no call
    assert calls == [] and reason in ("stop", "length")
    with pytest.raises(UserError, match="constrains the output itself"):
        structured = SamplingParams(structured_outputs={"regex": "a+"})
        llm.chat(MESSAGES, structured, tools=TOOLS, tool_choice="required")


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_forced_calls_are_exact_under_every_drafter(tools_model: Path, method: str) -> None:
    plain = LLM(str(tools_model), dtype="float32")
    config = example_config(method, tools_model)
    fast = LLM(str(tools_model), dtype="float32", speculative_config=config)
    for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
        assert _calls(fast, choice) == _calls(plain, choice), (method, choice)


def test_the_terminal_chat_shows_an_answers_calls(tools_model: Path) -> None:
    llm = LLM(str(tools_model), dtype="float32")
    tools = llm.tool_request(TOOLS, {"type": "function", "function": {"name": "forecast"}})
    session = ChatSession(llm, SamplingParams(temperature=0.0, max_tokens=96), None, tools)
    lines = iter(["Will it rain?"])
    reports: list[str] = []

    def read(_: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    session.run(read, lambda _: None, reports.append)
    (call,) = [line for line in reports if line.startswith("[tool call: ")]
    (said,) = [m for m in session.messages if m["role"] == "assistant"]
    arguments = said["tool_calls"][0]["function"]["arguments"]
    assert call == f"[tool call: forecast({arguments})]" and said["content"] == ""
    jsonschema.validate(json.loads(arguments), FORECAST)


REAL = "qwen2.5-coder-1.5b"


@pytest.mark.real_model
@pytest.mark.skipif(not is_pulled(REAL), reason=f"needs the pulled {REAL} (`specdecode pull`)")
@pytest.mark.slow
def test_qwen_calls_the_right_tool_on_the_tools_set() -> None:
    """The real model (gguf) on the bench's 10 tools prompts, greedy: with tool_choice
    "required", at least 9 answers call the expected function with arguments valid against
    its schema; with "auto", its own <tool_call> blocks parse as calls; ngram gives the same
    tokens."""
    llm = LLM(REAL)
    ngram = llm.with_speculative_config({"method": "ngram", "num_speculative_tokens": 8})
    params = SamplingParams(temperature=0.0, max_tokens=96)
    right = {"required": 0, "auto": 0}
    for prompt in load_prompts(["tools"], per_set=10):
        tools, expected = json.loads(prompt.tools), json.loads(prompt.expected_call)
        function = next(t["function"] for t in tools if t["function"]["name"] == expected["name"])
        for choice in right:
            (out,) = llm.chat(list(prompt.messages), params, tools=tools, tool_choice=choice)
            calls = out.outputs[0].tool_calls
            if calls and calls[0].name == expected["name"]:
                jsonschema.validate(json.loads(calls[0].arguments), function["parameters"])
                right[choice] += 1
            (same,) = ngram.chat(list(prompt.messages), params, tools=tools, tool_choice=choice)
            assert same.token_ids == out.token_ids, (prompt.id, choice)
    assert right["required"] >= 9 and right["auto"] >= 8, right
