"""Training examples for draft heads: ShareGPT exchanges and code from Python's own library.

Two sources, interleaved deterministically:
- ShareGPT V3 (`specdecode.corpus.sharegpt`): the first human turn and its answer, from conversation
  `HELD_OUT_CONVERSATIONS` on (the first ones are held out);
- code: the top-level functions of the Python standard library's own modules that have a
  docstring, asked for by name, signature and docstring; the answer is the library's source.

Nothing that overlaps the benchmark's prompt sets is used (`BenchFilter`: any shared run of
`OVERLAP_CHARS` characters, whitespace and case aside, drops the example).
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specdecode.corpus.prompts import available_sets, load_prompts
from specdecode.corpus.sharegpt import HELD_OUT_CONVERSATIONS, exchanges

OVERLAP_CHARS = 64  # a shared run this long (normalized) means an example touches the bench
CODE_EVERY = 5  # one code example after every CODE_EVERY - 1 ShareGPT ones


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt with an answer (the answer may be empty: the target writes it)."""

    id: str
    prompt: str
    answer: str


def sharegpt_examples(start: int = HELD_OUT_CONVERSATIONS) -> Iterator[Example]:
    """ShareGPT exchanges with a non-empty prompt, from conversation `start` on."""
    for ex in exchanges(start):
        if ex.prompt.strip():
            yield Example(f"sharegpt-{ex.id}", ex.prompt, ex.answer)


def stdlib_code_examples() -> Iterator[Example]:
    """Standard-library functions with a docstring (5-60 lines), asked for and answered with
    their own source, in a fixed order (modules sorted by path)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in file.parts[-2:][0] or file.name.startswith("test"):
            continue
        try:
            source = file.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            code = ast.get_source_segment(source, node)
            if not doc or not code or not 5 <= code.count("\n") + 1 <= 60:
                continue
            args = ast.unparse(node.args)
            prompt = (
                f"Write a Python function `{node.name}({args})`.\n\n{doc}\n\n"
                "Reply with the function in one Python code block."
            )
            yield Example(f"stdlib-{file.stem}.{node.name}", prompt, f"```python\n{code}\n```")


def interleaved(chat: Iterable[Example], code: Iterable[Example]) -> Iterator[Example]:
    """chat and code examples mixed: one code example after every CODE_EVERY - 1 chat ones,
    then whatever source is left."""
    chat_it, code_it = iter(chat), iter(code)
    n = 0
    while True:
        n += 1
        source = code_it if n % CODE_EVERY == 0 else chat_it
        item = next(source, None)
        if item is None:
            item = next(chat_it if source is code_it else code_it, None)
            if item is None:
                return
        yield item


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


class BenchFilter:
    """Says whether an example shares text with any of `texts` (the bench's prompts).

    Every OVERLAP_CHARS-long window of the normalized texts is indexed; an example is refused
    when any window of its prompt or answer, taken every OVERLAP_CHARS // 2 characters,
    is indexed (so any shared run of 1.5 * OVERLAP_CHARS characters is caught).
    """

    def __init__(self, texts: Iterable[str]) -> None:
        self.windows: set[str] = set()
        for text in texts:
            norm = _normalize(text)
            if len(norm) < OVERLAP_CHARS:
                self.windows.add(norm)
                continue
            for i in range(len(norm) - OVERLAP_CHARS + 1):
                self.windows.add(norm[i : i + OVERLAP_CHARS])

    def touches(self, example: Example) -> bool:
        """True when the example shares a run of text with the bench."""
        for text in (example.prompt, example.answer):
            norm = _normalize(text)
            if norm in self.windows:
                return True
            step = OVERLAP_CHARS // 2
            for i in range(0, max(len(norm) - OVERLAP_CHARS + 1, 0), step):
                if norm[i : i + OVERLAP_CHARS] in self.windows:
                    return True
        return False


def bench_texts() -> list[str]:
    """Every message of every benchmark prompt set (the bench's held-out ShareGPT prompts are
    outside the training range anyway)."""
    prompts = load_prompts(available_sets(), per_set=10_000)
    return [m["content"] for p in prompts for m in p.messages]
