"""The verification step's own cost, without a model: from a pass's logits to the verdicts.

A fake target gives random logits [B, K + 1, V] (V = 151,936, Qwen2.5's vocabulary); each row
drafts K tokens, the first half of them the target's argmax (so verdicts accept some). The
script times what the engine does with those logits per step, greedy (temperature 0) and
sampled (temperature 0.8), at B = 1 and 16 and K = 0, 3, 8, as the median of `--repeats`.

It runs against whichever specdecode is importable, so one checkout's numbers can be set
beside another's in one session (e.g. `PYTHONPATH=/tmp/old/src python benchmarks/...`): with
`specdecode.sampling.decide` it times `decide` (greedy rows on token ids), else the earlier
path (`probs_from_logits` over every row, then `verify_chain`).

    python benchmarks/step_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

from specdecode.sampling.probs import SamplingTensors

try:
    from specdecode.sampling_params import SamplingParams
except ImportError:  # the earlier layout
    from specdecode.types import SamplingParams
from specdecode.types import Draft

VOCAB = 151_936
NEW = importlib.util.find_spec("specdecode.sampling.decide") is not None


def case(batch: int, k: int, temperature: float, seed: int = 0):
    """Logits [B, K + 1, V], the drafts (K tokens, half of them the argmax), the params."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, VOCAB, generator=gen)  # [B, K + 1, V]
    best = logits.argmax(-1)  # [B, K + 1]
    drafts = []
    for row in range(batch):
        tokens = torch.randint(VOCAB, (k,), generator=gen)
        tokens[: k // 2] = best[row, : k // 2]
        drafts.append(Draft(tokens))
    params = [SamplingParams(temperature=temperature, seed=row) for row in range(batch)]
    return logits, drafts, params


def step_once(logits, drafts, params) -> None:
    """What the engine does with one pass's logits: this checkout's path."""
    st = SamplingTensors.from_params(params, "cpu")
    generators = [torch.Generator().manual_seed(p.seed) for p in params]
    if NEW:
        from specdecode.sampling.decide import decide, pad_tokens

        tokens, lengths = pad_tokens(drafts, logits.device)
        _ = decide(logits, drafts, tokens, lengths, None, st, generators).verdicts
        return
    from specdecode.engine.step import pad_drafts
    from specdecode.sampling.probs import probs_from_logits
    from specdecode.sampling.rejection import verdicts, verify_chain

    tokens, q, lengths = pad_drafts(drafts, VOCAB, logits.device)
    p = probs_from_logits(logits, st)  # [B, K + 1, V]
    verdicts(*verify_chain(p, tokens, q, lengths, generators, st.greedy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the medians (ms) here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = {"path": "decide" if NEW else "probs+verify_chain", "ms": {}}
    print(f"path: {out['path']}")
    print("| rows B | K | greedy ms | sampled ms |")
    print("|---|---|---|---|")
    for batch in (1, 16):
        for k in (0, 3, 8):
            row = {}
            for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
                logits, drafts, params = case(batch, k, temperature)
                step_once(logits, drafts, params)  # warm-up
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    step_once(logits, drafts, params)
                    times.append(time.perf_counter() - start)
                row[name] = statistics.median(times) * 1e3
            out["ms"][f"B={batch},K={k}"] = row
            print(f"| {batch} | {k} | {row['greedy']:.2f} | {row['sampled']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
