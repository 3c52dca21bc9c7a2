"""Where a target pass over T new tokens spends its time, per part of a layer, on this CPU.

Times real forward passes (`Transformer.forward` over `--context` cached tokens, as
verification runs them) with a timer around every part: each projection (qkv, o, gate_up,
down; the head), attention, the KV-cache write, RMSNorm, RoPE, the MLP's activation (SiLU or
GELU), the embedding. A block that runs as one native call (`Block.native`: DECODE passes in
bf16, int8 and gguf) is timed whole, as "native blocks", its parts inside it; `--op-by-op`
runs every block from Python instead, so each part shows (same bits, more dispatch). "python +
dispatch" is the pass's time minus the parts: module calls, views, the residual adds and the
gated product, metadata. Activation quantization runs inside the int8
kernel; its share is estimated separately (the kernel over a 64-row weight of the same input
width: quantization plus a negligible product).

Per T: median ms per pass over `--repeats` passes (after one untimed pass), each part's median
ms per pass, and T's cost relative to T = 1. The widths are timed in rounds (each once a
round, the order reversed every other round), so that the machine's drift (memory bandwidth
moves from minute to minute) reaches every width alike. The parts are timed inside the same
passes, so their sum is the pass (less "python + dispatch").

Usage: python benchmarks/pass_profile.py [--model qwen2.5-coder-1.5b] [--quantization int8]
       [--widths 1,4,9,16] [--context 256] [--repeats 7] [--op-by-op]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specdecode import kernels
from specdecode.bench.machine import machine_facts, wait_until_quiet
from specdecode.cache.kv_cache import KVCache
from specdecode.engine.costs import interleaved_seconds, verification_passes
from specdecode.llm import LLM
from specdecode.model import attention
from specdecode.model import transformer as tf

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class Timers:
    """Seconds per named part, summed over one pass."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, with its wall time added to `name`."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return timed


def instrument(model: nn.Module, timers: Timers) -> None:
    """Put a timer around every part of `model`'s pass (instance attributes, module functions:
    the model's code runs unchanged)."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in PROJECTIONS:
            module.forward = timers.wrap(leaf, module.forward)
    model.embed_tokens.forward = timers.wrap("embedding", model.embed_tokens.forward)
    for fn, part in (
        ("decode_attention", "attention"),
        ("rms_norm", "rms_norm"),
        ("rope_", "rope"),
    ):
        setattr(kernels, fn, timers.wrap(part, getattr(kernels, fn)))
    attention.attend = timers.wrap("attention", attention.attend)
    tf.F.silu = timers.wrap("activation", tf.F.silu)
    tf.F.gelu = timers.wrap("activation", tf.F.gelu)
    KVCache.write = timers.wrap("cache write", KVCache.write)
    for block in model.layers:  # a whole block as one native call: its parts run inside
        if block.native is not None:
            block.native = timers.wrap("native blocks", block.native)


def quantization_ms(model: tf.Transformer, width: int, repeats: int) -> float:
    """Estimated ms per pass of activation quantization: the int8 kernel over a 64-row weight
    for every int8 projection input of the pass (4 per layer and the head)."""
    cfg = model.config
    inputs = {cfg.hidden_size: 3 * cfg.num_layers + 1, cfg.intermediate_size: cfg.num_layers}
    total = 0.0
    for in_features, calls in inputs.items():
        small = kernels.pack(torch.ones(64, in_features, dtype=torch.int8), kernels.INT8_PACK)
        scale, rows = torch.ones(64), torch.zeros(64, dtype=torch.int32)
        x = torch.randn(width, in_features).to(model.dtype)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            kernels.int8_linear(x, small, scale, rows, None, 64)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times[1:]) * calls
    return total * 1e3


@torch.inference_mode()
def profile(model: tf.Transformer, widths: list[int], context: int, repeats: int) -> list[dict]:
    """Per width: the pass's median ms and each part's median ms per pass (the passes of
    `verification_passes`, timed in `interleaved_seconds`' rounds)."""
    timers = Timers()
    passes = verification_passes(model, context, [(1, width) for width in widths])
    instrument(model, timers)  # (after the context's prefill)
    parts: dict[int, dict[str, list[float]]] = {width: defaultdict(list) for width in widths}

    def with_parts(width: int, run: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            timers.seconds.clear()
            run()
            for name, seconds in timers.seconds.items():
                parts[width][name].append(seconds)

        return call

    seconds = interleaved_seconds(
        {width: with_parts(width, run) for (_, width), run in passes.items()}, repeats
    )
    out = []
    for width in widths:  # each part's first entry is the untimed round's
        row = {name: statistics.median(v[1:]) * 1e3 for name, v in parts[width].items()}
        row["pass"] = seconds[width] * 1e3
        out.append({"width": width, **row})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--widths", default="1,4,9,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--op-by-op", action="store_true", help="run every block from Python: each part shows"
    )
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    llm = LLM(args.model, args.dtype, quantization=args.quantization)
    model = llm.model
    if args.op_by_op:
        for block in model.layers:
            block.native = None
    facts = machine_facts()
    print(
        f"{args.model} {args.quantization}, {facts['cpu']}, {facts['torch_threads']} threads, "
        f"kernels {kernels.native().isa()}, context {args.context}"
    )
    quant = (
        {w: quantization_ms(model, w, args.repeats) for w in widths}
        if model.quantization == "int8"
        else {}
    )
    wait_until_quiet(10)
    rows = profile(model, widths, args.context, args.repeats)
    names = [
        *PROJECTIONS,
        "attention",
        "cache write",
        "rms_norm",
        "rope",
        "activation",
        "embedding",
        "native blocks",
    ]
    one = rows[0]["pass"]
    print("\nms per pass (median of the passes); the projections include the int8 kernel's")
    print("activation quantization, estimated on its own in the next-to-last line")
    print("| part | " + " | ".join(f"T={r['width']}" for r in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r.get(name, 0.0):.2f}" for r in rows) + " |")
    rest = [r["pass"] - sum(r.get(n, 0.0) for n in names) for r in rows]
    print("| python + dispatch | " + " | ".join(f"{v:.2f}" for v in rest) + " |")
    if quant:
        print(
            "| (int8 activation quantization) | "
            + " | ".join(f"{quant[r['width']]:.2f}" for r in rows)
            + " |"
        )
    print(
        "| **pass** | "
        + " | ".join(f"**{r['pass']:.1f}** ({r['pass'] / one:.2f}x)" for r in rows)
        + " |"
    )


if __name__ == "__main__":
    main()
