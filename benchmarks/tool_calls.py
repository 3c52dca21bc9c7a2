"""How well a model calls tools, and whether speculation keeps its calls: the "tools" prompt set
(`corpus/data/tools.jsonl`: a request, 2-3 tools, the right call written down) through
`LLM.chat(..., tools=...)`, greedy, under each `tool_choice`.

    python benchmarks/tool_calls.py --model qwen2.5-coder-1.5b \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 8}'

Per tool_choice ("auto": the model's own format, read by its parser; "required": constrained to
a JSON array of calls; "named": constrained to the expected function's arguments): the share of
answers with a call, with the right function first, whose arguments validate against its
schema, and whose arguments hold every expected value. With `--speculative-config`, each answer
is generated again with it and must equal plain decoding's token for token (the calls
included); the wall times of both give the speedup (one pass each, interleaved per prompt: a
first look; the bench's "tools" category measures speed properly).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import jsonschema

from specdecode.corpus.prompts import load_prompts
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.tool_calls.tools import parse_tools


def _check(out: Any, prompt: Any) -> dict[str, bool]:
    """What one answer got right (module docstring)."""
    calls = out.outputs[0].tool_calls
    expected = json.loads(prompt.expected_call)
    tools = {t.name: t for t in parse_tools(json.loads(prompt.tools))}
    right = bool(calls) and calls[0].name == expected["name"]
    valid = holds = False
    if right:
        arguments = json.loads(calls[0].arguments)
        try:
            jsonschema.validate(arguments, dict(tools[expected["name"]].parameters))
            valid = True
        except jsonschema.ValidationError:
            pass
        holds = all(arguments.get(k) == v for k, v in expected["arguments"].items())
    return {"called": bool(calls), "right_function": right, "valid": valid, "values": holds}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--speculative-config", default=None, help="JSON, as `serve` takes it")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    plain = LLM(args.model, quantization=args.quantization)
    fast = None
    if args.speculative_config is not None:
        fast = plain.with_speculative_config(json.loads(args.speculative_config))
    prompts = load_prompts(["tools"], per_set=1000)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows: list[dict[str, Any]] = []
    for mode in ("auto", "required", "named"):
        for prompt in prompts:
            expected = json.loads(prompt.expected_call)["name"]
            choice = (
                {"type": "function", "function": {"name": expected}} if mode == "named" else mode
            )
            chat = {"tools": json.loads(prompt.tools), "tool_choice": choice}
            started = time.perf_counter()
            (out,) = plain.chat(list(prompt.messages), params, **chat)
            row = {"mode": mode, "id": prompt.id, "plain_s": time.perf_counter() - started}
            row.update(_check(out, prompt))
            row["tokens"] = len(out.token_ids)
            row["calls"] = [(c.name, c.arguments) for c in out.outputs[0].tool_calls]
            if fast is not None:
                started = time.perf_counter()
                (other,) = fast.chat(list(prompt.messages), params, **chat)
                row["fast_s"] = time.perf_counter() - started
                row["identical"] = other.token_ids == out.token_ids
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| tool_choice | called | right function | valid | values | identical | speedup |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("auto", "required", "named"):
        mine = [r for r in rows if r["mode"] == mode]
        keys = ("called", "right_function", "valid", "values")
        share = {k: sum(r[k] for r in mine) / len(mine) for k in keys}
        same = speed = ""
        if fast is not None:
            same = f"{sum(r['identical'] for r in mine)}/{len(mine)}"
            speed = f"{sum(r['plain_s'] for r in mine) / sum(r['fast_s'] for r in mine):.2f}x"
        print(
            f"| {mode} | {share['called']:.0%} | {share['right_function']:.0%} | "
            f"{share['valid']:.0%} | {share['values']:.0%} | {same} | {speed} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
