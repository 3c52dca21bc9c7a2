"""The tools a request offers (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), checked,
and what they make of the prompt and the output's constraint.

- `parse_tools`: OpenAI's function tools -> `Tool`s (a clear UserError naming the entry).
- `parse_tool_choice`: "none", "auto", "required" or {"type": "function", "function": {"name":
  ...}} -> `ToolChoice`.
- `constraint`: "required" and a named function constrain the whole output (vLLM's way): for
  "required", a JSON array of calls `[{"name": ..., "arguments": {...}}, ...]` (one call unless
  parallel calls are allowed), each one's arguments valid against its function's parameters;
  for a named function, its arguments object alone; compact JSON (no optional whitespace: a
  small model stuck in blanks cannot run to max_tokens). "auto" leaves the output free (the model's
  own format, read by a `parsers` parser); "none" asks for no call.
- `template_messages`: a conversation with assistant `tool_calls` and `tool` messages in the
  shape chat templates read (arguments as objects, not JSON text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from specdecode.errors import UserError
from specdecode.sampling_params import StructuredOutputsParams

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call: its name, description and JSON-schema parameters
    (an object schema; `EMPTY_PARAMETERS` when the request gave none)."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def as_template(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's request shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How the model may call tools: "none", "auto", "required", or "named" (`name` alone)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None


def parse_tools(tools: Sequence[Any]) -> tuple[Tool, ...]:
    """OpenAI's `tools` list -> `Tool`s: each {"type": "function", "function": {"name",
    "description"?, "parameters"?}}, names distinct and of letters, digits, _ and - (at most
    64); UserError naming the entry otherwise."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise UserError("tools must be a non-empty list of {'type': 'function', ...} objects")
    parsed: list[Tool] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise UserError(f"{where}: only function tools are supported, got {kind!r}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise UserError(f"{where} needs a 'function' object with at least a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise UserError(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise UserError(f"{where}.function.description must be a string")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise UserError(
                f"{where}.function.parameters must be a JSON schema of an object "
                '({"type": "object", "properties": {...}})'
            )
        if any(t.name == name for t in parsed):
            raise UserError(f"{where}: the function name {name!r} is given twice")
        parsed.append(Tool(name, description, dict(parameters)))
    return tuple(parsed)


def parse_tool_choice(choice: Any, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI's `tool_choice` (None: "auto" with tools, "none" without) -> `ToolChoice`; a
    named function must be one of `tools`."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise UserError(f"tool_choice {choice!r} needs tools")
        return ToolChoice(choice)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        known = [t.name for t in tools]
        if name not in known:
            raise UserError(f"tool_choice names the function {name!r}, which tools lack: {known}")
        return ToolChoice("named", name)
    raise UserError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        f'{{"name": ...}}}}, got {choice!r}'
    )


def constraint(
    tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The output's constraint for `choice` (module docstring); None for "none" and "auto"."""
    if choice.mode == "named":
        (tool,) = (t for t in tools if t.name == choice.name)
        return StructuredOutputsParams(json=dict(tool.parameters), disable_any_whitespace=True)
    if choice.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.name]}, "arguments": dict(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates read them: content None -> "", each assistant tool call's
    `arguments` JSON text -> its object (templates render it with `tojson`)."""
    shaped = []
    for index, message in enumerate(messages):
        out = {**message, "content": message.get("content") or ""}
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [_template_call(call, f"messages[{index}]") for call in calls]
        shaped.append(out)
    return shaped


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise UserError(f"{where}.tool_calls: each call needs a function with a name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            raise UserError(
                f"{where}.tool_calls: the arguments of {function['name']!r} are not JSON: {error}"
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}
