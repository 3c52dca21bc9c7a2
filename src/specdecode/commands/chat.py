"""`specdecode chat MODEL`: an interactive chat in the terminal, on the same engine as
everything else. Each answer streams as it is generated (through the model's chat template,
with speculation when given a `--speculative-config`) and ends with one line of its numbers.
Ctrl-C stops an answer (what was said so far stays in the conversation), not the session;
`/reset` forgets the conversation, `/exit` or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdecode.cli_args import (
    add_sampling_flags,
    add_speculative_flag,
    add_weight_flags,
    llm_from_args,
    sampling_from_args,
)
from specdecode.commands.generate import summary
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.tool_calls.request import ToolRequest
from specdecode.types import RequestOutput

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer"


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode chat`."""
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal (streamed, with speculation)",
        description="An interactive chat: type a message, the answer streams, then a line of "
        f"its numbers. {HELP}.",
    )
    p.add_argument("model", help="alias, Hugging Face folder or .gguf file")
    p.add_argument("--system", default=None, help="a system message opening the conversation")
    p.add_argument(
        "--max-tokens", type=int, default=1024, help="new tokens per answer at most (default 1024)"
    )
    p.add_argument(
        "--tools",
        type=Path,
        default=None,
        help="a JSON file of OpenAI function tools ([{'type': 'function', 'function': {...}}]) "
        "the model may call; each answer's calls are shown after it",
    )
    p.add_argument(
        "--tool-choice",
        default=None,
        help="auto (default with --tools), required, none, or a function's name",
    )
    add_sampling_flags(p)
    add_weight_flags(p)
    add_speculative_flag(p)


def run_chat(args: argparse.Namespace) -> int:
    """`specdecode chat`: load the model, then converse until /exit or end of input."""
    llm = llm_from_args(args)
    tools = None
    if args.tools is not None:
        choice = args.tool_choice
        if choice not in (None, "auto", "required", "none"):
            choice = {"type": "function", "function": {"name": choice}}
        tools = llm.tool_request(_read_tools(args.tools), choice)
    elif args.tool_choice is not None:
        raise UserError("--tool-choice needs --tools FILE")
    session = ChatSession(llm, sampling_from_args(args), args.system, tools)
    if sys.stdin.isatty():
        importlib.import_module("readline")  # line editing and history for input()
    print(f"specdecode chat: {args.model} ({llm.weight_format}). {HELP}.", file=sys.stderr)
    session.run(input, _write, _report)
    return 0


class ChatSession:
    """A conversation with `llm`: its messages so far (the `system` one first, if any), each
    answer generated under `params` (its max_tokens capped to the context left), with the
    functions of `tools` offered (each answer's calls read out of it)."""

    def __init__(
        self,
        llm: LLM,
        params: SamplingParams,
        system: str | None = None,
        tools: ToolRequest | None = None,
    ) -> None:
        if llm.tokenizer.chat_template is None:
            raise UserError(
                "this model has no chat template: `specdecode chat` needs one; use "
                "`specdecode generate --prompt ...` for plain completion"
            )
        self.llm, self.params, self.tools = llm, params, tools
        self.opening = [] if system is None else [{"role": "system", "content": system}]
        self.messages: list[dict[str, Any]] = list(self.opening)
        rule = None if tools is None else tools.constraint()
        if rule is not None:
            self.params = replace(params, structured_outputs=rule)

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = list(self.opening)

    def answer(self, text: str, write: Callable[[str], None]) -> tuple[RequestOutput | None, bool]:
        """Say `text` and stream the answer to `write`; (its output, whether Ctrl-C stopped it).
        The answer, whole or stopped, joins the conversation."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.llm.chat_prompt(self.messages, self.tools)
        context = self.llm.model.config.max_position_embeddings
        room = context - len(prompt["prompt_token_ids"])
        if room < 1:
            self.messages.pop()
            raise UserError(
                f"the conversation has {context - room} tokens, the model's context is "
                f"{context}: /reset to start again"
            )
        params = replace(self.params, max_tokens=min(self.params.max_tokens, room))
        out, printed, stopped = None, 0, False
        try:
            with closing(self.llm.stream(prompt, params)) as outputs:
                for out in outputs:
                    write(out.text[printed:])
                    printed = len(out.text)
        except KeyboardInterrupt:  # the stream's close aborted the request
            stopped = True
        if out is not None and self.tools is not None and not stopped:
            out = self.tools.apply(out)
        self.messages.append(self._said(out))
        return out, stopped

    def _said(self, out: RequestOutput | None) -> dict[str, Any]:
        """The answer as the conversation keeps it: its text, or, when it calls tools, the
        text around the calls and the calls."""
        calls = () if out is None else out.outputs[0].tool_calls
        if out is None or not calls or self.tools is None:
            return {"role": "assistant", "content": "" if out is None else out.text}
        content = self.tools.read(out.text).content
        ids = [f"call_{len(self.messages)}_{i}" for i in range(len(calls))]
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [c.as_openai(i) for c, i in zip(calls, ids, strict=True)],
        }

    def run(
        self,
        read: Callable[[str], str],
        write: Callable[[str], None],
        report: Callable[[str], None],
    ) -> None:
        """Read messages with `read(PROMPT)` until /exit or end of input (EOFError); answer
        each through `write`, then `report` its numbers. Ctrl-C at the prompt clears it."""
        while True:
            try:
                line = read(PROMPT).strip()
            except EOFError:
                write("\n")
                return
            except KeyboardInterrupt:
                write("\n")
                continue
            if line in ("/exit", "/quit"):
                return
            if line == "/reset":
                self.reset()
                report("[conversation reset]")
                continue
            if line.startswith("/"):
                known = line in ("/help", "/?")
                report(f"[{HELP}]" if known else f"[unknown command {line.split()[0]}: {HELP}]")
                continue
            if not line:
                continue
            try:
                out, stopped = self.answer(line, write)
            except UserError as error:
                report(f"[error: {error}]")
                continue
            write("\n")
            for call in () if out is None else out.outputs[0].tool_calls:
                report(f"[tool call: {call.name}({call.arguments})]")
            if out is not None and out.metrics is not None:
                speculative = self.llm.speculative_config is not None
                note = "stopped (Ctrl-C), " if stopped else ""
                report(f"[{note}{summary(out, speculative)}]")
            elif stopped:
                report("[stopped (Ctrl-C) before the first token]")


def _read_tools(path: Path) -> Any:
    """The tools file's JSON (UserError naming the file when it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"--tools {path}: {error}") from None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
