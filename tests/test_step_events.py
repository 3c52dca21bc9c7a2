"""Step events (`SamplingParams(step_events=True)`) and the per-request draft limit
(`num_speculative_tokens`): the events describe exactly what each step drafted, kept and
committed, asking for them changes no token, and a request's own K bounds its drafts."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from spec_cases import GREEDY
from spec_cases import PROMPTS as SPEC_PROMPTS
from test_tree_engine import TreeOracle

from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.types import CompletionOutput, StepEvent

SPEC_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2},
    "draft": {"num_speculative_tokens": 3, "draft_length": "fixed"},  # drafting for itself
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                   "tree_width": 3, "tree_depth": 4},
    "tree": {},  # TreeOracle: random trees with the target's continuation on one branch
}  # fmt: skip
EVENTS = replace(GREEDY, step_events=True)
# The shared prompts, and one whose suffix (1, 2) was followed by three different tokens (a
# branching tree for ngram).
PROMPTS = [*SPEC_PROMPTS, {"prompt_token_ids": [1, 2, 7, 1, 2, 8, 5, 1, 2, 9, 6, 3, 1, 2]}]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def expected(plain: LLM) -> list[tuple[int, ...]]:
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def _speculative(
    plain: LLM, tiny_model_dir: Path, name: str, expected: list[tuple[int, ...]] | None = None
) -> LLM:
    if name == "tree":
        assert expected is not None
        continuations = {
            tuple(p["prompt_token_ids"]): list(e) for p, e in zip(PROMPTS, expected, strict=True)
        }
        return LLM(model=str(tiny_model_dir), dtype="float32", drafter=TreeOracle(continuations, 6))
    config = dict(SPEC_CONFIGS[name])
    if name == "draft":
        config["model"] = str(tiny_model_dir)
    return plain.with_speculative_config(config)


def check_events(out: CompletionOutput) -> None:
    """The events of one output agree with it and with themselves."""
    steps = out.steps
    assert [s.index for s in steps] == list(range(len(steps)))
    assert steps[0].drafted == () and steps[0].final == "sampled" and len(steps[0].tokens) == 1
    assert tuple(t for s in steps for t in s.tokens) == out.token_ids
    assert "".join(p for s in steps for p in s.pieces) == out.text
    for step in steps:
        assert len(step.pieces) == len(step.tokens) <= step.num_accepted + 1
        if step.parents is None:  # a chain: the accepted tokens are the draft's first ones
            kept = list(step.drafted[: step.num_accepted])
            rejected = step.drafted[step.num_accepted : step.num_accepted + 1]
            below = step.num_accepted < len(step.drafted)
        else:  # a tree: the accepted tokens are the path's nodes
            assert step.path is not None and len(step.path) == step.num_accepted
            kept = [step.drafted[n] for n in step.path]
            last = step.path[-1] if step.path else -1
            below = last in step.parents
            rejected = ()
        assert list(step.tokens[: step.num_accepted]) == kept[: len(step.tokens)]
        if step.drafted:
            assert step.final == ("correction" if below else "bonus")
        if step.final == "correction" and rejected and len(step.tokens) > step.num_accepted:
            assert step.tokens[step.num_accepted] != rejected[0]  # greedy: a real correction
        assert step.batch_size >= 1 and step.draft_s >= 0.0 and step.verify_s > 0.0
    assert all(a.elapsed_s <= b.elapsed_s for a, b in itertools.pairwise(steps))


@pytest.mark.parametrize("name", sorted(SPEC_CONFIGS))
def test_events_describe_every_step_and_change_nothing(
    plain: LLM, tiny_model_dir: Path, expected: list[tuple[int, ...]], name: str
) -> None:
    llm = _speculative(plain, tiny_model_dir, name, expected)
    quiet = llm.generate(PROMPTS, GREEDY)
    loud = llm.generate(PROMPTS, EVENTS)
    assert [o.token_ids for o in loud] == [o.token_ids for o in quiet] == expected
    assert all(o.outputs[0].steps == () for o in quiet)  # off by default
    for out in loud:
        check_events(out.outputs[0])
        assert out.metrics is not None
        steps = out.outputs[0].steps
        assert sum(s.num_accepted for s in steps) == out.metrics.spec.num_accepted_tokens
        assert sum(len(s.drafted) for s in steps) == out.metrics.spec.num_draft_tokens
    finals = {s.final for o in loud for s in o.outputs[0].steps}
    assert {"sampled", "bonus"} <= finals  # the repetitive prompts are drafted right
    if name == "tree":
        assert any(s.parents is not None for o in loud for s in o.outputs[0].steps)


def test_plain_decoding_has_one_sampled_token_per_step(plain: LLM) -> None:
    (out,) = plain.generate(PROMPTS[:1], EVENTS)
    steps = out.outputs[0].steps
    assert len(steps) == len(out.token_ids)
    assert all(s.drafted == () and s.final == "sampled" and len(s.tokens) == 1 for s in steps)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_request_own_draft_limit_bounds_its_drafts_only(
    plain: LLM, tiny_model_dir: Path, expected: list[tuple[int, ...]], k: int
) -> None:
    llm = _speculative(plain, tiny_model_dir, "draft")
    limited = replace(EVENTS, num_speculative_tokens=k)
    params = [limited, EVENTS, limited, EVENTS, limited]  # limited and unlimited rows, one batch
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    for out, sp in zip(outs, params, strict=True):
        longest = max(len(s.drafted) for s in out.outputs[0].steps)
        if sp is limited:
            assert longest <= k
            assert out.metrics is not None and (out.metrics.spec.num_drafts > 0) == (k > 0)
        else:
            assert longest == 3 or len(out.token_ids) < 5


def test_pieces_stop_where_a_stop_string_cuts_the_step(plain: LLM, tiny_model_dir: Path) -> None:
    llm = _speculative(plain, tiny_model_dir, "draft")
    (free,) = llm.generate(PROMPTS[1:2], EVENTS)
    stop = free.text[len(free.text) // 3 : len(free.text) // 3 + 3]
    (cut,) = llm.generate(PROMPTS[1:2], replace(EVENTS, stop=(stop,)))
    steps = cut.outputs[0].steps
    assert tuple(t for s in steps for t in s.tokens) == cut.token_ids
    assert all(len(s.pieces) == len(s.tokens) for s in steps)
    assert "".join(p for s in steps for p in s.pieces).startswith(cut.text)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_speculative_tokens": -1},
        {"num_speculative_tokens": 65},
        {"num_speculative_tokens": True},
        {"num_speculative_tokens": 2.0},
        {"step_events": "yes"},
    ],
)
def test_bad_values_are_refused_with_what_is_allowed(fields: dict) -> None:
    with pytest.raises(UserError, match=r"(num_speculative_tokens|step_events) must be"):
        SamplingParams(**fields)


def test_event_as_dict_is_json_shaped() -> None:
    event = StepEvent(2, (5, 6), None, 1, None, "correction", (5, 9), ("a", "b"), 0.1, 0.2, 1, 3.0)
    data = event.as_dict()
    assert data["drafted"] == [5, 6] and data["tokens"] == [5, 9] and data["parents"] is None
    assert data["final"] == "correction" and data["pieces"] == ["a", "b"]
