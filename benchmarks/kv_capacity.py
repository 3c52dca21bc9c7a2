"""The paged KV cache's room against the rectangular cache it replaced, on the serve benchmark's
request mix (bench prompts `--prompts`, chat template, `--max-tokens`, as
benchmarks/serve_load.py sends them).

    python benchmarks/kv_capacity.py --model smollm2-135m --streams 16

The budget is the KV slots the rectangular cache needed for `--streams` requests of the mix
(rows x the longest request's need: prompt + max_tokens + the draft slots). In that budget:
1. the requests the rectangular rule admitted at once, and those the paged scheduler admits
   (`Scheduler.admit`: the blocks each holds through its next step), in arrival order;
2. a run of 4 x `--streams` requests of the mix (greedy, EOS ignored, `--method` drafting,
   `max_num_seqs` unlimited) within the budget: per step while requests wait, the requests
   running; after every step, the blocks the rows hold and the pool's blocks, x the block
   size, over the tokens the rows hold; the preemptions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.corpus.prompts import load_prompts
from specdecode.engine.engine import Engine
from specdecode.engine.request import Request
from specdecode.engine.scheduler import Scheduler, SchedulerConfig, kv_need
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams


def mix(llm: LLM, sets: list[str], per_set: int) -> list[list[int]]:
    """The serve benchmark's prompts: each set's prompts interleaved, chat template applied."""
    tok = llm.tokenizer
    groups = [load_prompts([name], per_set) for name in sets]
    return [
        tok.encode(tok.apply_chat_template(list(p.messages), add_generation_prompt=True), False)
        for group in zip(*groups, strict=False)
        for p in group
    ]


def requests(llm: LLM, prompts: list[list[int]], count: int, max_tokens: int) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    context = llm.model.config.max_position_embeddings
    return [
        Request(f"r{i}", None, prompts[i % len(prompts)], params, (), context) for i in range(count)
    ]


def admitted(reqs: list[Request], budget: int, draft_tokens: int) -> tuple[int, int]:
    """Requests running at once within `budget` KV slots: (rectangular rule, paged rule)."""
    longest, rect = 0, 0
    for req in reqs:  # rows x the longest need, in arrival order
        longest = max(longest, kv_need(req))
        if (rect + 1) * longest > budget:
            break
        rect += 1
    sched = Scheduler(SchedulerConfig(max_num_seqs=len(reqs), kv_cache_tokens=budget))
    for req in reqs:
        sched.add(req)
    return rect, len(sched.admit(draft_tokens))


def run(llm: LLM, reqs: list[Request], budget: int) -> dict[str, float]:
    """Run `reqs` within `budget` KV slots (module docstring, 2.)."""
    engine = llm.engine
    config = SchedulerConfig(max_num_seqs=len(reqs), kv_cache_tokens=budget)
    engine = Engine(llm.model, llm.tokenizer, engine.drafter, engine.draft_length, scheduler=config)
    for req in reqs:
        engine.add(req)
    running, rows, pool = [], [], []
    while engine.has_unfinished():
        engine.step()
        if engine.num_waiting:
            running.append(engine.num_running)
        cache = engine.kv.cache
        tokens = 0 if cache is None else sum(cache.lengths)
        if tokens:
            rows.append(cache.num_blocks * BLOCK_TOKENS / tokens)
            pool.append(cache.pool.num_blocks * BLOCK_TOKENS / tokens)
    return {
        "running_while_requests_wait_median": statistics.median(running),
        "running_while_requests_wait_min": min(running),
        "preemptions": sum(r.num_preemptions for r in reqs),
        "row_blocks_over_tokens_median": statistics.median(rows),
        "row_blocks_over_tokens_max": max(rows),
        "pool_over_tokens_median": statistics.median(pool),
        "pool_over_tokens_max": max(pool),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--prompts", default="code,chat")
    p.add_argument("--per-set", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--method", default=None, help="a speculative config as JSON (default plain)")
    args = p.parse_args(argv)
    spec = json.loads(args.method) if args.method else None
    llm = LLM(args.model, quantization=args.quantization, speculative_config=spec)
    prompts = mix(llm, args.prompts.split(","), args.per_set)
    pool = requests(llm, prompts, 8 * args.streams, args.max_tokens)
    longest = max(kv_need(r) for r in pool[: args.streams])
    budget = args.streams * longest  # the rectangular cache's room for --streams of the mix
    rect, paged = admitted(pool, budget, llm.engine.draft_length.max_tokens)
    lengths = [len(q) for q in prompts]
    print(f"mix: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"(median {statistics.median(lengths):.0f}), max_tokens {args.max_tokens}")  # fmt: skip
    print(f"budget {budget} slots: rectangular admits {rect}, paged {paged} "
          f"({paged / rect:.2f}x)")  # fmt: skip
    measured = run(llm, requests(llm, prompts, 4 * args.streams, args.max_tokens), budget)
    print(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
