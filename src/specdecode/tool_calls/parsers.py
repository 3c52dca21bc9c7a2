"""Reading tool calls out of a model's output text, per the format its family was trained on
(vLLM's `--tool-call-parser` names), and out of the constrained formats of `tools.constraint`.

- hermes (Qwen2.5, Qwen3, Hermes, ...): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>` blocks, anywhere in the text; the text around them is the content. Small
  models often leave the tags out and answer with the call's JSON alone, bare or in a
  ```json fence (Qwen2.5-Coder-1.5B in gguf does on all 10 of the bench's tools prompts): a
  whole answer that is such a call (or several) of an offered function is read as one too.
- llama3_json (Llama 3.1+): the whole output is one or more `{"name": ..., "parameters":
  {...}}` objects (`;`-separated), optionally after `<|python_tag|>`.
- mistral: `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}` objects; the text
  before it is the content.
- "required" (`tools.constraint`'s array of calls) and a named function (its arguments object
  alone) are read by `CallArrayParser` and `ArgumentsParser`.

`parse(text, final)` reads the whole text so far. While `final` is False (a stream), text that
may still turn out to be a call (an open block, a partial marker) is held: left out of the
content and not read as a call yet. The content of one text is a prefix of the content of any
text that continues it, so a stream sends each `content[sent:]`. At the end (`final`), a block
that does not parse as a call is content after all.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from specdecode.errors import UserError
from specdecode.types import ToolCall


@dataclass(frozen=True, slots=True)
class Parsed:
    """What an output text holds: its `content` (the text that is not a call) and its calls."""

    content: str
    calls: tuple[ToolCall, ...] = ()


def _call(value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """{"name": str, <an arguments key>: object} -> ToolCall (arguments as compact JSON)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            if isinstance(arguments, str):  # some models write the arguments as JSON text
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            if not isinstance(arguments, Mapping):
                return None
            return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    return ToolCall(value["name"], "{}")


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    """Reads the calls out of one format's text (module docstring); `names`: the functions
    offered (a format that guesses reads only calls of these)."""

    name: ClassVar[str]

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self.names = names

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls of `text`; while not `final`, what may become a call is held."""


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    FENCE = "```json"

    def parse(self, text: str, final: bool) -> Parsed:
        if self.OPEN not in text and self.names:
            bare = self._bare(text.strip(), final)
            if bare is not None:
                return bare
        content: list[str] = []
        calls: list[ToolCall] = []
        at = 0
        while True:
            start = text.find(self.OPEN, at)
            if start < 0:
                rest = text[at:]
                held = 0 if final else _partial_marker(rest, self.OPEN)
                content.append(rest[: len(rest) - held])
                break
            content.append(text[at:start])
            end = text.find(self.CLOSE, start)
            if end < 0 and not final:
                break  # an open block: held
            body_end = len(text) if end < 0 else end
            call = self._read(text[start + len(self.OPEN) : body_end])
            if call is None:  # not a call after all: content
                content.append(text[start : body_end + (0 if end < 0 else len(self.CLOSE))])
            else:
                calls.append(call)
            if end < 0:
                break
            at = end + len(self.CLOSE)
        return Parsed("".join(content), tuple(calls))

    @staticmethod
    def _read(body: str) -> ToolCall | None:
        try:
            return _call(json.loads(body))
        except json.JSONDecodeError:
            return None

    def _bare(self, body: str, final: bool) -> Parsed | None:
        """A whole answer that is a call's JSON without the tags (bare or fenced), or, while
        not final, may still become one (held); None: read it the usual way."""
        if not final:
            maybe = body.startswith(("{", self.FENCE)) or self.FENCE.startswith(body)
            return Parsed("") if maybe and body else None
        if body.startswith(self.FENCE) and body.endswith("```"):
            body = body[len(self.FENCE) : -3].strip()
        calls = _objects(body, ("arguments", "parameters")) if body.startswith("{") else ()
        if calls and all(c.name in self.names for c in calls):
            return Parsed("", calls)
        return None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        body = body.removeprefix(self.TAG).lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            maybe = not body or self.TAG.startswith(body)
            return Parsed("" if maybe and not final else text)
        if not final:
            return Parsed("")  # a call, or JSON the model wrote as its answer: held to the end
        calls = _objects(body, ("parameters", "arguments"))
        return Parsed("", calls) if calls else Parsed(text)


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.MARKER)
        if start < 0:
            held = 0 if final else _partial_marker(text, self.MARKER)
            return Parsed(text[: len(text) - held])
        if not final:
            return Parsed(text[:start])
        calls = _objects(text[start + len(self.MARKER) :].strip(), ("arguments",))
        return Parsed(text[:start], calls) if calls else Parsed(text)


class CallArrayParser(ToolParser):
    """`tool_choice: "required"`: the whole text is a JSON array of {"name", "arguments"}."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        if not final:
            return Parsed("")
        calls = _objects(text.strip(), ("arguments",))
        return Parsed("", calls) if calls else Parsed(text)


class ArgumentsParser(ToolParser):
    """A named `tool_choice`: the whole text is the function's arguments object."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__(frozenset({function}))
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        if not final:
            return Parsed("")
        call = _call({"name": self.function, "arguments": text.strip() or "{}"})
        return Parsed("", (call,)) if call is not None else Parsed(text)


def _objects(body: str, arguments_keys: tuple[str, ...]) -> tuple[ToolCall, ...]:
    """The calls of a JSON array of call objects, or of call objects one after another (`;` or
    whitespace between them); () if any part is not a call."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return ()
        values.extend(value if isinstance(value, list) else [value])
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    calls = [_call(v, arguments_keys) for v in values]
    if not calls or any(c is None for c in calls):
        return ()
    return tuple(c for c in calls if c is not None)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}
# What in a chat template tells its family's format, in the order they are tried.
TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)


def parser_name(template: str | None, given: str | None = None) -> str | None:
    """The parser for a model: `given` (checked), else the one its chat template's markers
    name, else None (the template renders no tool calls we can read)."""
    if given is not None:
        if given not in PARSERS:
            raise UserError(f"unknown tool-call parser {given!r}; known: {', '.join(PARSERS)}")
        return given
    for marker, name in TEMPLATE_MARKERS:
        if template is not None and marker in template:
            return name
    return None
