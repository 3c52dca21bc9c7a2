"""What a long prompt arriving does to the streams already running, with and without chunked
prefill (engine level: the server's steps are these steps).

`--streams` short chat prompts decode (greedy, EOS ignored); after `--warm-steps` steps a
`--long-tokens`-token prompt (docs/serving.md, repeated) arrives, and the engine steps until
its first token. Every step's wall time is shared over the tokens it gave the running streams
(as the server's inter-token latency histogram does). Prints, for chunked prefill on and off
(two engines on the same weights, prefix caching off in both, one run each after the other):
the median ITL before the arrival, the median, p99 and worst ITL while the long prompt
prefilled, p99 / median, the long prompt's TTFT and its steps.

Usage: python benchmarks/chunked_prefill.py [--model smollm2-135m] [--quantization auto]
       [--streams 16] [--long-tokens 4000] [--warm-steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specdecode.engine.scheduler import SchedulerConfig
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(llm: LLM, args: argparse.Namespace, long_ids: list[int]) -> dict[str, float]:
    """One arrival on `llm`'s engine: ITLs before and during the long prompt's prefill."""
    engine = llm.engine
    streams = []
    for i in range(args.streams):
        prompt = llm.chat_prompt([{"role": "user", "content": f"Count from {i} upwards."}])
        params_i = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
        streams.append(llm.make_request(prompt, params_i))
        engine.add(streams[-1])

    def step() -> tuple[float, int]:
        before = sum(len(r.output_ids) for r in streams)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        return seconds, sum(len(r.output_ids) for r in streams) - before

    while any(r.prefilling for r in streams):
        step()
    before = []
    for _ in range(args.warm_steps):
        seconds, tokens = step()
        before += [seconds / tokens] * tokens
    long = llm.make_request({"prompt_token_ids": long_ids}, SamplingParams(max_tokens=1))
    engine.add(long)
    arrived, during, steps = time.perf_counter(), [], 0
    while long.prefilling:
        seconds, tokens = step()
        during += [seconds / max(1, tokens)] * max(1, tokens)
        steps += 1
    ttft = time.perf_counter() - arrived
    for request in streams:
        engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    median = statistics.median(before)
    return {
        "median_itl_s": median,
        "median_during_s": statistics.median(during),
        "p99_itl_s": _pct(during, 0.99),
        "worst_itl_s": max(during),
        "p99_over_median": _pct(during, 0.99) / median,
        "long_ttft_s": ttft,
        "long_steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=4000)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--warm-steps", type=int, default=8)
    args = parser.parse_args()
    chunked = LLM(model=args.model, quantization=args.quantization)
    chunked.set_scheduler(SchedulerConfig(prefix_cache_tokens=0, chunked_prefill=True))
    whole = chunked.with_speculative_config(None)
    whole.set_scheduler(SchedulerConfig(prefix_cache_tokens=0, chunked_prefill=False))
    ids = chunked.tokenizer.encode(DOC.read_text() * 4, add_special_tokens=False)
    long_ids = ids[: args.long_tokens]
    print(
        f"{args.model} ({chunked.weight_format}), {args.streams} streams, "
        f"a {len(long_ids)}-token prompt arrives"
    )
    print(
        "chunked  median_itl_s  median_during_s  p99_itl_s  worst_itl_s  p99/median  "
        "long_ttft_s  steps"
    )
    for name, llm in (("on", chunked), ("off", whole)):
        r = run(llm, args, long_ids)
        print(
            f"{name:7s}  {r['median_itl_s']:12.3f}  {r['median_during_s']:15.3f}  "
            f"{r['p99_itl_s']:9.3f}  "
            f"{r['worst_itl_s']:11.3f}  {r['p99_over_median']:10.2f}  {r['long_ttft_s']:11.2f}"
            f"  {r['long_steps']:5d}"
        )


if __name__ == "__main__":
    main()
