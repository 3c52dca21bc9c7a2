"""Is a change slower? Two checkouts of specdecode timed in the same run, turn about.

Runs one worker process per checkout (`--old`, `--new`: a tree whose kernels are built in place,
e.g. `git worktree add /tmp/base REV` then `python setup.py build_ext --inplace` there), each
importing specdecode from its own `src/` and loading the target once per method. The workers
take turns, one at a time (old then new in even rounds, new then old in odd ones): every round
times each method in both checkouts on the same prompts (greedy, one request at a time), so
the machine's minute-to-minute speed moves both sides of a pair alike. Prints per method the
tokens/s of each checkout (median over rounds) and the new / old ratio of each round's pair
(median and range), and checks that both checkouts produce the same tokens, and every method
the same tokens (greedy: those of plain decoding).

Methods are the bench's specs (`specdecode bench --methods`: plain, ngram:k=8,
draft:qwen2.5-coder-0.5b:k=3, ...), parsed here and handed to the workers as
speculative_config dicts, so the old checkout must know the methods' config fields.

Usage: python benchmarks/ab_checkouts.py --old /tmp/base [--new .] [--model qwen2.5-coder-1.5b]
       [--quantization gguf] [--methods plain,ngram:k=8,draft:qwen2.5-coder-0.5b:k=3]
       [--prompts code,chat] [--per-set 1] [--max-tokens 48] [--rounds 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

READY, RESULT = "ab_checkouts ready", "ab_checkouts result"  # a worker's lines to the driver


def _config_dict(spec: str) -> dict[str, Any] | None:
    """A bench method spec -> the speculative_config dict that builds it (None for plain): the
    method and the fields that differ from their defaults."""
    from specdecode.bench.methods import MethodSpec

    parsed = MethodSpec.parse(spec).config
    if parsed is None:
        return None
    config = parsed.drafter
    out: dict[str, Any] = {"method": config.method}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = str(value) if isinstance(value, Path) else value
    if parsed.draft_length != config.default_draft_length:
        out["draft_length"] = parsed.draft_length
    return out


def _worker(job: dict[str, Any]) -> None:
    """Load every method's LLM and run its prompts once, say READY (and where specdecode came
    from), then per line of stdin (a method's index) time the prompts and print a JSON line."""
    import specdecode
    from specdecode.corpus.prompts import load_prompts
    from specdecode.llm import LLM
    from specdecode.sampling_params import SamplingParams

    prompts = [list(p.messages) for p in load_prompts(job["sets"], job["per_set"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    llms = []
    for config in job["configs"]:
        llm = LLM(job["model"], quantization=job["quantization"], speculative_config=config)
        for prompt in prompts:  # untimed: the first pass of each shape allocates
            llm.chat([prompt], params)
        llms.append(llm)
    print(READY, Path(specdecode.__file__).resolve(), flush=True)
    for line in sys.stdin:
        llm = llms[int(line)]
        tokens, digest = 0, hashlib.sha1()
        start = time.perf_counter()
        for prompt in prompts:
            ids = llm.chat([prompt], params)[0].outputs[0].token_ids
            tokens += len(ids)
            digest.update(json.dumps(list(ids)).encode())
        elapsed = time.perf_counter() - start
        result = {"tps": tokens / elapsed, "digest": digest.hexdigest()}
        print(RESULT, json.dumps(result), flush=True)


def _read(proc: subprocess.Popen[str], marker: str) -> str | None:
    """The rest of the worker's next line that starts with `marker` (other lines, a library's
    prints, are skipped); None if the worker ended first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(marker + " "):
            return line[len(marker) + 1 :].rstrip("\n")
    return None


def _start(tree: Path, job: dict[str, Any]) -> subprocess.Popen[str]:
    """A worker importing specdecode from tree/src (its kernels built in place); returns once
    it has loaded and run everything."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    where = _read(proc, READY)
    if where is None:
        proc.kill()
        raise SystemExit(f"the worker for {tree} did not start (see its stderr above)")
    if not Path(where).is_relative_to(tree / "src"):
        proc.kill()
        raise SystemExit(f"the worker for {tree} imported specdecode from {where}")
    return proc


def _ask(proc: subprocess.Popen[str], method: int) -> dict[str, Any]:
    """Time method number `method` in the worker: {"tps", "digest"}."""
    stdin: IO[str] | None = proc.stdin
    assert stdin is not None
    stdin.write(f"{method}\n")
    stdin.flush()
    result = _read(proc, RESULT)
    if result is None:
        raise SystemExit("a worker ended (see its stderr above)")
    return json.loads(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--old", type=Path, help="the checkout to compare against")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--methods", default="plain,ngram:k=8,draft:qwen2.5-coder-0.5b:k=3")
    parser.add_argument("--prompts", default="code,chat", help="the bench's prompt sets")
    parser.add_argument("--per-set", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    if args.old is None:
        parser.error("--old is required: a checkout with its kernels built in place")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    job = {
        "model": args.model,
        "quantization": args.quantization,
        "configs": [_config_dict(m) for m in methods],
        "sets": args.prompts.split(","),
        "per_set": args.per_set,
        "max_tokens": args.max_tokens,
    }
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    procs = {name: _start(tree, job) for name, tree in trees.items()}
    keys = [(name, i) for name in trees for i in range(len(methods))]
    tps: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    digests: dict[tuple[str, int], set[str]] = {key: set() for key in tps}
    try:
        for r in range(args.rounds):
            for i in range(len(methods)):
                for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    out = _ask(procs[name], i)
                    tps[name, i].append(out["tps"])
                    digests[name, i].add(out["digest"])
            pairs = ", ".join(
                f"{m} {tps['new', i][-1] / tps['old', i][-1]:.3f}" for i, m in enumerate(methods)
            )
            print(f"round {r + 1}: new / old {pairs}", flush=True)
    finally:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()
    print(
        f"\n{args.model} {args.quantization}, {args.prompts} x {args.per_set}, "
        f"{args.max_tokens} tokens, {args.rounds} rounds: tokens/s, median"
    )
    print("| method | old | new | new / old, median (range) |\n|---|---|---|---|")
    for i, m in enumerate(methods):
        old, new = tps["old", i], tps["new", i]
        ratios = [b / a for a, b in zip(old, new, strict=True)]
        print(
            f"| {m} | {statistics.median(old):.2f} | {statistics.median(new):.2f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )
    every = set().union(*digests.values())
    same_trees = all(digests["old", i] == digests["new", i] for i in range(len(methods)))
    print(
        f"tokens: old == new for every method: {same_trees}; "
        f"every method the same tokens: {len(every) == 1}"
    )


if __name__ == "__main__":
    main()
