"""A target pass with each decoder block as one native call (`Block.native`) against the same
blocks run op by op from Python, interleaved in one process.

Loads the model once, prefills `--context` random tokens, then times DECODE passes over T new
tokens (as decode steps and chain verification run them), switching every block between its
native call and its Python ops each round (the order alternates); the cache is truncated after
every pass. Per T: median (min) ms per pass of both, and the ratio of the medians. The outputs
are bit for bit the same either way (tests/test_model.py).

Usage: python benchmarks/native_blocks.py [--model smollm2-135m] [--quantization gguf]
       [--widths 1,4,9] [--context 256] [--rounds 9] [--passes 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.bench.machine import machine_facts, wait_until_quiet
from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--widths", default="1,4,9")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--passes", type=int, default=5, help="timed passes per round and variant")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = LLM(args.model, args.dtype, quantization=args.quantization).model
    natives = [block.native for block in model.layers]
    if any(native is None for native in natives):
        raise SystemExit(f"{args.model} in {model.quantization} has blocks without native calls")
    facts = machine_facts()
    print(f"{args.model} {model.quantization}, {facts['cpu']}, {facts['torch_threads']} threads")
    vocab, ctx = model.config.vocab_size, args.context
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, ctx + max(widths))
    times: dict[tuple[int, bool], list[float]] = {(w, n): [] for w in widths for n in (0, 1)}
    wait_until_quiet(10)
    with torch.inference_mode():
        model(
            torch.randint(vocab, (1, ctx), generator=gen),
            AttentionMetadata.prefill([ctx], "cpu"),
            cache,
        )
        for rnd in range(args.rounds + 1):  # round 0 warms up, untimed
            for width in widths:
                tokens = torch.randint(vocab, (1, width), generator=gen)
                meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [ctx], [width], "cpu")
                for native in (True, False) if rnd % 2 else (False, True):
                    for block, layer in zip(model.layers, natives, strict=True):
                        block.native = layer if native else None
                    for _ in range(args.passes):
                        t0 = time.perf_counter()
                        model(tokens, meta, cache)
                        elapsed = time.perf_counter() - t0
                        cache.truncate(ctx)
                        if rnd:
                            times[width, native].append(elapsed * 1e3)
    print("ms per pass, median (min) | Python blocks | native blocks | ratio |")
    for width in widths:
        py, nat = times[width, False], times[width, True]
        print(
            f"T={width}: | {statistics.median(py):.2f} ({min(py):.2f}) | "
            f"{statistics.median(nat):.2f} ({min(nat):.2f}) | "
            f"{statistics.median(py) / statistics.median(nat):.2f}x |"
        )


if __name__ == "__main__":
    main()
