"""What the peer libraries' bench tests share: a short bench config and a made-up run."""

from __future__ import annotations

from specdecode.bench.harness import LoopConfig
from specdecode.bench.records import Run
from specdecode.bench.run import BenchConfig


def peer_config(
    model: str, methods: str, prompts: tuple[str, ...], tokens: int, dtype: str
) -> BenchConfig:
    """One prompt a set, `tokens` new tokens always, one repeat, no waiting for quiet."""
    return BenchConfig(
        model=model,
        methods=methods,
        prompt_sets=prompts,
        per_set=1,
        max_tokens=tokens,
        ignore_eos=True,
        dtype=dtype,
        loop=LoopConfig(repeats=1, retries=0, quiet_wait_s=0, progress=False),
    )


def peer_run(method: str, tokens: list[int], wall: float) -> Run:
    """A code prompt's run of `method` that gave `tokens` in `wall` seconds."""
    return Run(
        wall_s=wall, ttft_s=0.1, token_ids=tuple(tokens), method=method, prompt_id="a",
        category="code", repeat=0, attempt=0, num_prompt_tokens=8, foreign_cores=0.0,
        disturbed=False,
    )  # fmt: skip
