"""Time to first token of a multi-turn chat, with and without prefix caching.

An 8-turn conversation over a ~1,000-token system prompt (the start of docs/serving.md, cut at
`--system-tokens`), greedy, `--max-tokens` per answer. Three engines share the loaded weights:
"warm" keeps its prefix cache across turns; "fresh" has one too, emptied before each turn (a
cold run under the same settings: its answer must equal warm's, bit for bit); "off" has none
and prefills each prompt in one batched pass (`ONE_PASS_PREFILL`: the speed baseline). Turn
by turn the conversation runs on each (the order rotates), and each turn's TTFT (the engine's
own `time_to_first_token_s`) is read. Prints, per turn, the cached prompt tokens, the three
TTFTs and warm / off, then the median of that ratio over turns 2.. and its spread, and
whether "off" gave the same answers too.

Usage: python benchmarks/prefix_chat.py [--model smollm2-135m] [--quantization auto]
       [--turns 8] [--system-tokens 1000] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specdecode.engine.scheduler import ONE_PASS_PREFILL
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

QUESTIONS = [
    "What does the engine thread do?",
    "How are requests admitted to the batch?",
    "What happens when a client disconnects?",
    "Which errors does the server return?",
    "How is the draft length chosen under load?",
    "What does the visualizer show?",
    "How do replicas work?",
    "Summarize the limits a request must fit.",
]
DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    warm = LLM(model=args.model, quantization=args.quantization)
    fresh = warm.with_speculative_config(None)
    off = warm.with_speculative_config(None)
    off.set_scheduler(ONE_PASS_PREFILL)
    runs = [("warm", warm), ("fresh", fresh), ("off", off)]
    ids = warm.tokenizer.encode(DOC.read_text(), add_special_tokens=False)
    system = warm.tokenizer.decode(ids[: args.system_tokens])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    messages = [{"role": "system", "content": system}]
    print(f"{args.model} ({warm.weight_format}), system prompt {args.system_tokens} tokens")
    print("turn  prompt  cached  warm_s  fresh_s   off_s  warm/off")
    ratios, off_same = [], True
    for turn in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        prompt = warm.chat_prompt(messages)
        fresh.engine.kv.prefix_cache.clear()
        shift = turn % len(runs)
        outs = {name: llm.generate(prompt, params)[0] for name, llm in runs[shift:] + runs[:shift]}
        if outs["warm"].token_ids != outs["fresh"].token_ids:
            raise SystemExit(f"turn {turn + 1}: a prefix hit changed the answer")
        off_same &= outs["warm"].token_ids == outs["off"].token_ids
        ttft = {name: out.metrics.time_to_first_token_s for name, out in outs.items()}
        ratio = ttft["warm"] / ttft["off"]
        if turn:
            ratios.append(ratio)
        size, cached = len(prompt["prompt_token_ids"]), outs["warm"].metrics.num_cached_tokens
        print(
            f"{turn + 1:4d}  {size:6d}  {cached:6d}  {ttft['warm']:6.3f}  {ttft['fresh']:7.3f}  "
            f"{ttft['off']:6.3f}  {ratio:8.3f}"
        )
        messages.append({"role": "assistant", "content": outs["warm"].text})
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    print(f"turns 2-{args.turns}: median warm/off {statistics.median(ratios):.3f} ({spread})")
    print(f"answers without a prefix cache (batched prefill) the same too: {off_same}")


if __name__ == "__main__":
    main()
