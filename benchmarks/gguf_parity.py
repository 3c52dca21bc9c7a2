"""Parity with llama.cpp on the same GGUF file: teacher-forced next-token argmax agreement.

Each prompt of the chosen bench sets, rendered with the model's chat template, is read in one
prefill by llama.cpp (llama-cpp-python, the file's own blocks) and by specdecode in each format
asked for; the share of positions whose argmax agrees is printed per format (and per set).
quantization="gguf" computes with the same blocks as llama.cpp, so what is left is the engines'
arithmetic. Both are also compared with the exact model (the file's weights dequantized to fp32,
fp32 activations: `exact_model`), the yardstick of how much each one's rounding moves.
Needs `pip install llama-cpp-python==0.3.36`.

Usage: python benchmarks/gguf_parity.py --model qwen2.5-coder-1.5b [--formats gguf,int8,none]
       [--dtype bfloat16] [--prompts code,chat,summarize,qa] [--per-set 2]
"""

from __future__ import annotations

import argparse

from specdecode import LLM
from specdecode.bench.llamacpp import gguf_of
from specdecode.bench.parity import argmax_agreement, exact_model, llamacpp_logits, our_logits
from specdecode.corpus.prompts import load_prompts


def _share(ours: list, theirs: list) -> float:
    agree, total = argmax_agreement(ours, theirs)
    return agree / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--formats", default="gguf,int8,none")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="code,chat,summarize,qa")
    p.add_argument("--per-set", type=int, default=2)
    args = p.parse_args()
    prompts = load_prompts(args.prompts.split(","), args.per_set)
    theirs = exact = None
    for name in args.formats.split(","):
        llm = LLM(args.model, dtype=args.dtype, quantization=name)
        sequences = [llm.chat_prompt(list(q.messages))["prompt_token_ids"] for q in prompts]
        if theirs is None:
            gguf = gguf_of(args.model, llm.model_path)
            theirs = llamacpp_logits(gguf, sequences)
            exact = our_logits(exact_model(gguf, llm.model.config), sequences)
            agree, total = argmax_agreement(theirs, exact)
            print(f"{len(sequences)} prompts, {total} positions")
            print(f"llama.cpp vs the exact model: {agree / total:.4f}")
        ours = our_logits(llm.model, sequences)
        print(f"{name} ({args.dtype}) vs the exact model: {_share(ours, exact):.4f}")
        agree, total = argmax_agreement(ours, theirs)
        per_set = {}
        for q, a, b in zip(prompts, ours, theirs, strict=True):
            hits, count = per_set.get(q.category, (0, 0))
            got, n = argmax_agreement([a], [b])
            per_set[q.category] = (hits + got, count + n)
        sets = ", ".join(f"{c} {h / n:.3f}" for c, (h, n) in per_set.items())
        share = f"{agree}/{total} = {agree / total:.4f}"
        print(f"{name} ({args.dtype}) vs llama.cpp: {share}  ({sets})")


if __name__ == "__main__":
    main()
