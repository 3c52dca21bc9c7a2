"""The benchmark loop: every method on every prompt, interleaved, each group redone if disturbed.

Order: for each repeat, for each prompt, every method once (a "group"). The method order of
the group of repeat r and prompt i is rotated by r + i places, so no method always runs first
or right after the same other method (a warm or cold cache, the previous engine's threads still
winding down), even with one repeat, and every prompt sees several orders over the repeats.
One short untimed warm-up run per method comes first. A group during which other processes
used >= `QUIET_CORES` of CPU is set aside and run again (at most `retries` times; the last
attempt is kept whatever its load, and marked "disturbed").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from tqdm import tqdm

from specdecode.bench.machine import (
    QUIET_CORES,
    descendants_cpu_s,
    wait_until_quiet,
    with_foreign_load,
)
from specdecode.bench.methods import MethodSpec
from specdecode.bench.records import Run
from specdecode.bench.runners import Runner
from specdecode.corpus.prompts import BenchPrompt
from specdecode.energy import cpu_seconds
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

WARMUP_TOKENS = 16  # new tokens of each method's untimed warm-up run


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """How the loop runs.

    repeats: timed runs of every (method, prompt).
    retries: times a disturbed group is run again.
    quiet_wait_s: the longest wait for a quiet machine before each group (0 = do not wait).
    progress: show a progress bar on stderr.
    """

    repeats: int = 2
    retries: int = 2
    quiet_wait_s: float = 60.0
    progress: bool = True


def method_order(names: Sequence[str], shift: int) -> list[str]:
    """`names` rotated left by `shift` places: shift 1 of [a, b, c] gives b, c, a."""
    shift = shift % len(names)
    return list(names[shift:]) + list(names[:shift])


def chat_ids(llm: LLM, prompt: BenchPrompt) -> list[int]:
    """The prompt's token ids: its messages, and the tools it offers, through `llm`'s chat
    template (every engine of the bench gets these ids)."""
    tools = None if prompt.tools is None else llm.tool_request(json.loads(prompt.tools))
    return llm.chat_prompt(list(prompt.messages), tools)["prompt_token_ids"]


def prompt_params(spec: MethodSpec, prompt: BenchPrompt, params: SamplingParams) -> SamplingParams:
    """`params` for one method on one prompt: constrained by the prompt's JSON schema when it
    has one and the method is (`MethodSpec.constrained`)."""
    if prompt.schema is None or not spec.constrained:
        return params
    return replace(params, structured_outputs={"json": prompt.schema})


def run_interleaved(
    runners: Sequence[Runner],
    prompts: Sequence[tuple[BenchPrompt, list[int]]],
    params: SamplingParams,
    config: LoopConfig,
    log: Callable[[Run], None] | None = None,
) -> tuple[list[Run], list[Run]]:
    """Run every runner on every (prompt, token ids); return (kept runs, discarded runs), each
    `Run` the runner's `Timing` with the method, prompt, repeat, attempt and load it ran at."""
    by_name = {r.spec.name: r for r in runners}
    warm = replace(params, max_tokens=min(params.max_tokens, WARMUP_TOKENS))
    for runner in runners:  # warm-up: first-call costs (allocations, lazy init) are not timed
        runner.run(prompts[0][1], prompt_params(runner.spec, prompts[0][0], warm))
    total = config.repeats * len(prompts) * len(runners)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not config.progress)
    kept: list[Run] = []
    discarded: list[Run] = []
    for repeat in range(config.repeats):
        for index, (prompt, ids) in enumerate(prompts):
            order = method_order(list(by_name), repeat + index)
            for attempt in range(config.retries + 1):
                if config.quiet_wait_s > 0:
                    wait_until_quiet(config.quiet_wait_s)
                group = []
                for name in order:
                    cpu = cpu_seconds() + descendants_cpu_s()  # a peer's worker's too
                    runner = by_name[name]
                    asked = prompt_params(runner.spec, prompt, params)
                    timing, load = with_foreign_load(partial(runner.run, ids, asked))
                    cpu = cpu_seconds() + descendants_cpu_s() - cpu
                    run = Run.of(
                        timing,
                        method=name,
                        prompt_id=prompt.id,
                        category=prompt.category,
                        repeat=repeat,
                        attempt=attempt,
                        num_prompt_tokens=len(ids),
                        foreign_cores=load,
                        disturbed=load >= QUIET_CORES,
                        cpu_s=cpu,
                    )
                    if log is not None:
                        log(run)
                    group.append(run)
                if not any(r.disturbed for r in group) or attempt == config.retries:
                    kept += group
                    break
                discarded += group
            bar.update(len(order))
    bar.close()
    return kept, discarded
