"""One request's tools, all checked: what the chat template gets, what constrains the output and
which parser reads the calls out of it (the Python API's `LLM.chat` and the server share it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from specdecode.errors import UserError
from specdecode.sampling_params import StructuredOutputsParams
from specdecode.tool_calls.parsers import (
    PARSERS,
    ArgumentsParser,
    CallArrayParser,
    Parsed,
    ToolParser,
    parser_name,
)
from specdecode.tool_calls.tools import (
    Tool,
    ToolChoice,
    constraint,
    parse_tool_choice,
    parse_tools,
)
from specdecode.types import RequestOutput

RENDERS_TOOLS = re.compile(r"\btools\b")  # a chat template that reads the `tools` variable


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """tools: the functions offered; choice: how they may be called; parallel: several calls
    in one answer allowed; parser: what reads the output (None for tool_choice "none")."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool
    parser: ToolParser | None

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template reads them."""
        return [tool.as_template() for tool in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint ("required" and a named function), else None."""
        return constraint(self.tools, self.choice, self.parallel)

    def read(self, text: str, final: bool = True) -> Parsed:
        """The content and calls of an output text (all content when nothing is parsed)."""
        return Parsed(text) if self.parser is None else self.parser.parse(text, final)

    def apply(self, out: RequestOutput) -> RequestOutput:
        """`out` with each finished completion's `tool_calls` read from its text."""
        completions = tuple(
            replace(c, tool_calls=self.read(c.text).calls) if c.finish_reason else c
            for c in out.outputs
        )
        return replace(out, outputs=completions)


def tool_request(
    tools: Any,
    tool_choice: Any,
    parallel: bool,
    template: str | None,
    model: str,
    parser: str | None = None,
) -> ToolRequest | None:
    """The request's tools checked against `model`'s chat `template` (None when it offers
    none): UserError for bad tools or tool_choice, a template that does not render tools,
    or, for "auto", a model whose call format no parser knows (`parser` names one)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise UserError(f"tool_choice {tool_choice!r} needs tools")
        return None
    offered = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, offered)
    if template is None or not RENDERS_TOOLS.search(template):
        raise UserError(
            f"{model}'s chat template does not render tools, so the model cannot be told of "
            "them; use a model whose template does (e.g. qwen2.5-coder-1.5b)"
        )
    reader: ToolParser | None = None
    if choice.mode == "named":
        assert choice.name is not None
        reader = ArgumentsParser(choice.name)
    elif choice.mode == "required":
        reader = CallArrayParser(frozenset(t.name for t in offered))
    elif choice.mode == "auto":
        name = parser_name(template, parser)
        if name is None:
            raise UserError(
                f"{model}'s chat template shows no tool-call format we read (known: "
                f"{', '.join(PARSERS)}); name one (--tool-call-parser / tool_call_parser=), or "
                'ask for tool_choice "required" or a named function, which need none'
            )
        reader = PARSERS[name](frozenset(t.name for t in offered))
    return ToolRequest(offered, choice, parallel, reader)
