"""Parity with llama.cpp on the same GGUF file: teacher-forced next-token argmax agreement.

Each prompt of the chosen bench sets, rendered with the model's chat template, is read in one
prefill by llama.cpp (llama-cpp-python, the file's own blocks) and by specdecode in each format
asked for; the share of positions whose argmax agrees is printed per format (and per set).
quantization="gguf" computes with the same blocks as llama.cpp, so what is left is the engines'
arithmetic. Needs `pip install llama-cpp-python==0.3.36`.

Usage: python benchmarks/gguf_parity.py --model qwen2.5-coder-1.5b [--formats gguf,int8,none]
       [--dtype bfloat16] [--prompts code,chat,summarize,qa] [--per-set 2]
"""

from __future__ import annotations

import argparse

from specdecode import LLM
from specdecode.bench.llamacpp import gguf_of
from specdecode.bench.parity import argmax_agreement, llamacpp_logits, our_logits
from specdecode.bench.prompts import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--formats", default="gguf,int8,none")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="code,chat,summarize,qa")
    p.add_argument("--per-set", type=int, default=2)
    args = p.parse_args()
    prompts = load_prompts(args.prompts.split(","), args.per_set)
    theirs = None
    for name in args.formats.split(","):
        llm = LLM(args.model, dtype=args.dtype, quantization=name)
        sequences = [llm.chat_prompt(list(q.messages))["prompt_token_ids"] for q in prompts]
        if theirs is None:
            theirs = llamacpp_logits(gguf_of(args.model, llm.model_path), sequences)
            print(f"{len(sequences)} prompts, {sum(map(len, sequences))} positions")
        ours = our_logits(llm.model, sequences)
        agree, total = argmax_agreement(ours, theirs)
        per_set = {}
        for q, a, b in zip(prompts, ours, theirs, strict=True):
            hits, count = per_set.get(q.category, (0, 0))
            got, n = argmax_agreement([a], [b])
            per_set[q.category] = (hits + got, count + n)
        sets = ", ".join(f"{c} {h / n:.3f}" for c, (h, n) in per_set.items())
        print(f"{name} ({args.dtype}): {agree}/{total} = {agree / total:.4f}  ({sets})")


if __name__ == "__main__":
    main()
