"""docs/design.md's new-drafter walk-through, run as written: its example module and its one
registry line make a drafter that the API and the bench's method specs take, whose greedy
output equals plain decoding, and that the contract tests ask an example config of (so the
walk-through names what a new drafter really touches)."""

from __future__ import annotations

import re
import sys
import textwrap
import types
from pathlib import Path

import pytest
from drafter_examples import example_config
from spec_cases import GREEDY, PROMPTS

from specdecode.bench import methods
from specdecode.drafters import registry
from specdecode.drafters.base import SpeculativeConfig
from specdecode.llm import LLM

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _walkthrough() -> str:
    """The section "Where a new drafter goes" of design.md."""
    return DESIGN.read_text().split("## Where a new drafter goes", 1)[1].split("\n## ", 1)[0]


def test_the_walkthroughs_drafter_runs_as_written(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    section = _walkthrough()
    (module,) = re.findall(r"```python\n(.*?)```", section, re.S)
    repeat = types.ModuleType("repeat")  # drafters/repeat.py, a module of its own
    monkeypatch.setitem(sys.modules, "repeat", repeat)
    code = compile(
        textwrap.dedent(module), "design.md: drafters/repeat.py", "exec", dont_inherit=True
    )
    exec(code, repeat.__dict__)
    namespace = repeat.__dict__
    (line,) = re.findall(r"`(DrafterMethod\(.*?\))`", section, re.S)  # step 2's registry line
    entry = eval(" ".join(line.split()), {**namespace, "DrafterMethod": registry.DrafterMethod})
    assert entry.name == "repeat"
    # the line in registry.py's DRAFTERS (the bench reads the registry when it is imported)
    monkeypatch.setitem(registry.DRAFTERS, entry.name, entry)
    monkeypatch.setitem(methods.OURS, entry.bench_name, entry)

    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = {"method": "repeat", "num_speculative_tokens": 3}
    llm = plain.with_speculative_config(spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.spec_metrics.num_drafts > 0  # it drafted
    assert set(entry.bench_options) == {"k", "dl"}  # each tried here
    (bench,) = methods.parse_methods("repeat:k=4:dl=cost")
    repeat4 = namespace["RepeatConfig"](num_speculative_tokens=4)
    assert bench.config == SpeculativeConfig(repeat4, "cost")
    with pytest.raises(AssertionError, match="give the new drafter 'repeat' an example config"):
        example_config("repeat", tiny_model_dir)  # step 3: the contract tests ask for one
