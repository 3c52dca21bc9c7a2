"""Plain greedy decoding: specdecode vs Hugging Face transformers `generate()`, plus a roofline.

For every model: the same chat prompts (rendered once with the model's chat template, so both
engines see the same token ids), the same dtype, greedy decoding of exactly `--max-tokens` new
tokens on both sides (EOS ignored by both), runs interleaved (for each repeat, for each prompt:
ours then HF, the order flipped every repeat) after one warm-up run of each engine.

Measured per run (all raw numbers go to `DIR/plain_decode.json`):
- end to end: wall seconds of the whole request (prefill included) -> tokens/s;
- a timestamp per token: ours from `LLM.stream()` (one event per token whose text lands; a
  held-back token shows up with the next event), HF from a streamer passed to `generate()`
  (its first push is the prompt, then one push per new token); from them
  - time to first token (TTFT),
  - decode-only ms/token = (last token time - first token time) / (tokens - 1): prefill and
    the first token excluded, the same definition on both sides,
  - median inter-token latency (ITL), robust to another process taking a core for a while;
- the CPU load of other processes during the run (this machine is shared; a disturbed pair of
  runs is redone, see `ForeignLoad`);
- the generated token ids, to report greedy agreement (bf16 may diverge in small ways).

Roofline: read bandwidth of this machine (sum over a tensor far beyond the caches, median of
several runs) and the bytes of weights one decoded token reads (every linear weight and bias,
the norms, the head; the embedding lookup reads one row; a tied head reads the embedding matrix
as the head). floor ms/token = bytes / bandwidth; "% of floor" = floor / measured decode ms.

Usage:
    python benchmarks/plain_decode.py --models smollm2-135m,qwen2.5-coder-1.5b \
        --max-tokens 64 --repeats 3 --prompts 4 --dtype bfloat16 --out bench_out/plain_decode
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from prompts import chat_prompts
from torch import nn

from specdecode.bench.machine import (
    QUIET_CORES,
    ForeignLoad,
    machine_facts,
    wait_until_quiet,
    with_foreign_load,
)
from specdecode.bench.runners import load_hf
from specdecode.llm import LLM
from specdecode.model.registry import ensure_pulled
from specdecode.types import SamplingParams

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
BANDWIDTH_BYTES = 1 << 30  # 1 GiB per bandwidth probe: far beyond any cache here
BANDWIDTH_RUNS = 7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per run (>= 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="how many prompts of the set")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--retries", type=int, default=3, help="redo a pair disturbed by others")
    ap.add_argument("--quiet-wait", type=float, default=120.0, help="max s to wait for quiet")
    ap.add_argument("--report", help="only print the tables of a saved plain_decode.json")
    ap.add_argument("--out", default="bench_out/plain_decode", help="folder for the JSON")
    args = ap.parse_args(argv)
    if args.max_tokens < 2 or args.repeats < 1 or args.prompts < 1:
        ap.error("need --max-tokens >= 2 (decode needs two tokens), --repeats >= 1, --prompts >= 1")
    return args


def _timed_runs(fn, runs: int) -> list[float]:
    """Wall seconds of `runs` calls of `fn` (after one untimed call)."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


@torch.inference_mode()
def measure_bandwidth(nbytes: int = BANDWIDTH_BYTES, runs: int = BANDWIDTH_RUNS) -> dict[str, Any]:
    """Read bandwidth in GB/s (1e9 B/s): sum over bf16 and fp32 tensors, and a bf16 matvec.

    The sums are the floor-defining numbers (pure streaming reads); the matvec (`F.linear` of one
    row with a [nbytes / 32 KiB, 16384] bf16 matrix, decoding's shape, what HF runs) shows what a
    plain linear layer reaches.
    """
    out: dict[str, Any] = {}
    for name, dtype in (("sum_bf16", torch.bfloat16), ("sum_fp32", torch.float32)):
        x = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
        times = _timed_runs(lambda x=x: x.sum(), runs)
        out[name] = [nbytes / t / 1e9 for t in times]
        del x
    cols = 16384
    w = torch.ones(nbytes // 2 // cols, cols, dtype=torch.bfloat16)
    v = torch.ones(1, cols, dtype=torch.bfloat16)
    times = _timed_runs(lambda w=w: F.linear(v, w), runs)
    out["matvec_bf16"] = [nbytes / t / 1e9 for t in times]
    del w
    out["read_gb_s"] = max(statistics.median(out["sum_bf16"]), statistics.median(out["sum_fp32"]))
    out["matvec_gb_s"] = statistics.median(out["matvec_bf16"])
    return out


def bytes_per_token(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters one decoded token reads, for a model of plain torch modules (HF's).

    Every parameter is read whole, except an `nn.Embedding`, whose lookup reads one row. A tensor
    shared by several modules (a tied head) is counted once, at its largest read: the tied
    embedding matrix counts whole, as the head. Example (SmolLM2, tied): 30 blocks of linears
    + norms + the [49152, 576] matrix once.
    """
    reads: dict[int, int] = {}  # data_ptr -> bytes read
    total_params = 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            full = p.numel() * p.element_size()
            read = full // p.shape[0] if isinstance(module, nn.Embedding) else full
            ptr = p.data_ptr()
            if ptr not in reads:
                total_params += full
            reads[ptr] = max(reads.get(ptr, 0), read)
    return {"weight_bytes_read": sum(reads.values()), "parameter_bytes": total_params}


class TimingStreamer:
    """A `generate(streamer=...)` hook that timestamps every push (first push: the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        """Called by HF with the prompt, then with each new token."""
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Called by HF at the end of generation."""


def load_hf_no_eos(path: Path, dtype: torch.dtype) -> nn.Module:
    """The same converted folder in HF transformers, with EOS stopping switched off."""
    hf = load_hf(path, dtype, "cpu")
    hf.generation_config.eos_token_id = None  # ignore EOS, like our ignore_eos=True
    hf.generation_config.pad_token_id = 0  # batch of one: padding never happens
    return hf


def token_timings(t0: float, stamps: list[tuple[float, int]]) -> dict[str, float]:
    """TTFT and decode times from (time, tokens so far) stamps of one request started at t0.

    decode_ms_per_token: (last stamp - first token) / (tokens - 1), prefill and token 1 excluded.
    median_itl_ms: median inter-token latency, each token of a stamp that brought several counted
    at the per-token share; robust to another process stealing a core for part of the run.
    Example: stamps [(t0+0.10, 1), (t0+0.14, 2), (t0+0.22, 4)] -> TTFT 100 ms,
    decode 40 ms/token, per-token gaps [40, 40, 40] -> median 40 ms.
    """
    gaps = []
    for (ta, na), (tb, nb) in itertools.pairwise(stamps):
        gaps += [(tb - ta) / (nb - na) * 1e3] * (nb - na)
    (t_first, n_first), (t_last, n_last) = stamps[0], stamps[-1]
    return {
        "ttft_s": t_first - t0,
        "decode_ms_per_token": (t_last - t_first) / (n_last - n_first) * 1e3,
        "median_itl_ms": statistics.median(gaps),
    }


def run_ours(llm: LLM, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy request through our engine's stream, timestamping every output event."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stamps, out = [], None
    t0 = time.perf_counter()
    for out in llm.stream({"prompt_token_ids": ids}, params):
        stamps.append((time.perf_counter(), len(out.token_ids)))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        **token_timings(t0, stamps),
        "engine_metrics": out.metrics.as_dict(),
        "num_tokens": len(out.token_ids),
        "token_ids": list(out.token_ids),
    }


@torch.inference_mode()
def run_hf(hf: nn.Module, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy `generate()` of exactly `max_tokens` tokens; token times from a streamer."""
    input_ids = torch.tensor([ids])
    streamer = TimingStreamer()
    t0 = time.perf_counter()
    out = hf.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        streamer=streamer,
    )
    wall = time.perf_counter() - t0
    new = out[0, len(ids) :].tolist()
    stamps = [(t, n + 1) for n, t in enumerate(streamer.times[1:])]  # times[0]: the prompt
    return {
        "wall_s": wall,
        **token_timings(t0, stamps),
        "num_tokens": len(new),
        "token_ids": new,
    }


def _log(run: dict[str, Any]) -> None:
    """One progress line per run on stderr."""
    print(
        f"  rep {run['repeat']} {run['prompt_name']:<9} {run['engine']:<4} "
        f"{run['num_tokens']} tok {run['num_tokens'] / run['wall_s']:6.2f} tok/s  "
        f"decode {run['decode_ms_per_token']:7.1f} ms/tok (itl {run['median_itl_ms']:6.1f})  "
        f"ttft {run['ttft_s'] * 1e3:7.1f} ms  "
        f"foreign load {run['foreign_cores']:.2f} cores",
        file=sys.stderr,
        flush=True,
    )


def interleaved_runs(
    llm: LLM, hf: nn.Module, prompts: list[tuple[str, list[int]]], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Warm up both engines, then for each repeat and prompt run both, flipping the order.

    A pair during which another process used >= QUIET_CORES is kept aside and redone (at most
    --retries times; the last attempt is kept whatever its load). Returns (runs, discarded).
    """
    engines = {"ours": lambda ids: run_ours(llm, ids, args.max_tokens)}
    engines["hf"] = lambda ids: run_hf(hf, ids, args.max_tokens)
    for fn in engines.values():
        fn(prompts[0][1])  # warm-up
    runs, discarded = [], []
    for rep in range(args.repeats):
        order = ["ours", "hf"] if rep % 2 == 0 else ["hf", "ours"]
        for index, (name, ids) in enumerate(prompts):
            for attempt in range(args.retries + 1):
                waited = wait_until_quiet(args.quiet_wait)
                pair = []
                for engine in order:
                    run = with_foreign_load(partial(engines[engine], ids))
                    run.update(engine=engine, repeat=rep, prompt=index, prompt_name=name)
                    run.update(num_prompt_tokens=len(ids), attempt=attempt, waited_s=waited)
                    _log(run)
                    pair.append(run)
                if max(r["foreign_cores"] for r in pair) < QUIET_CORES or attempt == args.retries:
                    runs += pair
                    break
                discarded += pair
    return runs, discarded


def agreement(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy agreement of ours vs HF per prompt (first repeat), and each engine's determinism."""
    first = {(r["engine"], r["prompt"]): r["token_ids"] for r in runs if r["repeat"] == 0}
    prompts = sorted({p for _, p in first})
    per_prompt = []
    for p in prompts:
        a, b = first[("ours", p)], first[("hf", p)]
        diverge = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if diverge is None and len(a) != len(b):
            diverge = min(len(a), len(b))
        per_prompt.append({"prompt": p, "identical": diverge is None, "first_divergence": diverge})
    deterministic = {
        engine: all(
            r["token_ids"] == first[(engine, r["prompt"])] for r in runs if r["engine"] == engine
        )
        for engine in ("ours", "hf")
    }
    share = sum(x["identical"] for x in per_prompt) / len(per_prompt)
    return {"per_prompt": per_prompt, "share_identical": share, "deterministic": deterministic}


def _spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of `values`."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]], floor_ms: float) -> dict[str, Any]:
    """Per engine: tokens/s, decode ms/token and TTFT (median, min, max), % of the floor."""
    out: dict[str, Any] = {}
    for engine in ("ours", "hf"):
        mine = [r for r in runs if r["engine"] == engine]
        decode = _spread([r["decode_ms_per_token"] for r in mine])
        out[engine] = {
            "tokens_per_s": _spread([r["num_tokens"] / r["wall_s"] for r in mine]),
            "decode_ms_per_token": decode,
            "median_itl_ms": _spread([r["median_itl_ms"] for r in mine]),
            "ttft_ms": _spread([r["ttft_s"] * 1e3 for r in mine]),
            "pct_of_floor": 100.0 * floor_ms / decode["median"],
        }
    pairs = {(r["repeat"], r["prompt"]): {} for r in runs}
    for r in runs:
        pairs[(r["repeat"], r["prompt"])][r["engine"]] = r
    out["disturbed_runs_kept"] = sum(r["foreign_cores"] >= QUIET_CORES for r in runs)
    out["ratio_tokens_per_s"] = _spread(
        [p["hf"]["wall_s"] / p["ours"]["wall_s"] for p in pairs.values()]
    )
    for key in ("decode_ms_per_token", "median_itl_ms"):
        out[f"ratio_{key}"] = _spread([p["hf"][key] / p["ours"][key] for p in pairs.values()])
    return out


def render_prompts(llm: LLM, count: int) -> list[tuple[str, list[int]]]:
    """The benchmark prompts as token ids, through the model's chat template."""
    return [(name, llm.chat_prompt(msgs)["prompt_token_ids"]) for name, msgs in chat_prompts(count)]


def quiet_bandwidth(max_wait_s: float) -> dict[str, Any]:
    """`measure_bandwidth()` after waiting for quiet, with the other processes' load recorded."""
    wait_until_quiet(max_wait_s)
    load = ForeignLoad()
    load.start()
    out = measure_bandwidth()
    out["foreign_cores"] = load.stop()
    return out


def roofline(weights: dict[str, int], probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Floor ms/token from the bytes read per token and the best bandwidth probed around the runs.

    The machine is shared and its bandwidth drifts (30-58 GB/s seen), so the model is bracketed
    by two probes; the higher one gives the floor (a floor must not be slower than the machine).
    """
    read = max(p["read_gb_s"] for p in probes)
    low = min(p["read_gb_s"] for p in probes)
    matvec = max(p["matvec_gb_s"] for p in probes)
    return {
        "read_gb_s": read,
        "read_gb_s_lowest_probe": low,
        "matvec_gb_s": matvec,
        "floor_ms_per_token": weights["weight_bytes_read"] / (read * 1e9) * 1e3,
        "matvec_floor_ms_per_token": weights["weight_bytes_read"] / (matvec * 1e9) * 1e3,
        "probes": probes,
    }


def bench_model(alias: str, args: argparse.Namespace) -> dict[str, Any]:
    """Load `alias` in both engines, run the interleaved benchmark, return raw runs and stats."""
    ensure_pulled(alias)
    t0 = time.perf_counter()
    llm = LLM(model=alias, dtype=args.dtype)
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = load_hf_no_eos(llm.model_path, DTYPES[args.dtype])
    load_hf_s = time.perf_counter() - t0
    prompts = render_prompts(llm, args.prompts)
    weights = bytes_per_token(hf)  # ours may hold packed/quantized weights torch cannot size
    print(f"{alias}: {len(prompts)} prompts, {weights}", file=sys.stderr)
    before = quiet_bandwidth(args.quiet_wait)
    runs, discarded = interleaved_runs(llm, hf, prompts, args)
    roof = roofline(weights, [before, quiet_bandwidth(args.quiet_wait)])
    result = {
        "model": alias,
        "model_path": str(llm.model_path),
        "load_s": {"ours": load_ours, "hf": load_hf_s},
        "prompt_lengths": [len(ids) for _, ids in prompts],
        "weights": weights,
        "roofline": roof,
        "summary": summarize(runs, roof["floor_ms_per_token"]),
        "agreement": agreement(runs),
        "runs": runs,
        "discarded_runs": discarded,
    }
    del llm, hf
    gc.collect()
    return result


def _fmt(s: dict[str, float], digits: int = 1) -> str:
    """'median (min-max)'."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _divergence(index: int | None) -> str:
    """First divergence index, or '-' for identical outputs."""
    return "-" if index is None else str(index)


def _speed_rows(res: dict[str, Any]) -> list[str]:
    """Markdown rows of one model's speed table: ours (with the ours/HF ratios), then HF."""
    s = res["summary"]
    rows = []
    for engine in ("ours", "hf"):
        e = s[engine]
        ratios = ["", "", ""]
        if engine == "ours":
            keys = ("ratio_tokens_per_s", "ratio_decode_ms_per_token", "ratio_median_itl_ms")
            ratios = [_fmt(s[k], 2) for k in keys]
        rows.append(
            f"| {res['model']} | {engine} | {_fmt(e['tokens_per_s'], 2)} "
            f"| {_fmt(e['decode_ms_per_token'])} | {_fmt(e['median_itl_ms'])} "
            f"| {_fmt(e['ttft_ms'])} | {e['pct_of_floor']:.0f}% | {' | '.join(ratios)} |"
        )
    return rows


def markdown(results: list[dict[str, Any]]) -> str:
    """The results as markdown tables: speed per engine, then roofline and agreement."""
    lines = [
        "| model | engine | tokens/s e2e | decode ms/token | median ITL ms | TTFT ms "
        "| % of floor | ours/HF tok/s | ours/HF decode | ours/HF ITL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        lines += _speed_rows(res)
    lines += [
        "",
        "| model | weight MB read/token | read GB/s (lower probe) | floor ms/token | matvec GB/s "
        "| floor at matvec bw | prompt tokens | greedy identical | first divergence "
        "| disturbed runs kept / redone |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        agree, roof = res["agreement"], res["roofline"]
        firsts = ", ".join(_divergence(x["first_divergence"]) for x in agree["per_prompt"])
        lines.append(
            f"| {res['model']} | {res['weights']['weight_bytes_read'] / 1e6:.0f} "
            f"| {roof['read_gb_s']:.1f} ({roof['read_gb_s_lowest_probe']:.1f}) "
            f"| {roof['floor_ms_per_token']:.1f} "
            f"| {roof['matvec_gb_s']:.1f} | {roof['matvec_floor_ms_per_token']:.1f} "
            f"| {', '.join(map(str, res['prompt_lengths']))} "
            f"| {agree['share_identical']:.0%} | {firsts} "
            f"| {res['summary']['disturbed_runs_kept']} / {len(res['discarded_runs'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for every model; write JSON to --out and markdown to stdout."""
    args = parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())["results"]))
        return
    facts = machine_facts()
    print(f"machine: {facts}", file=sys.stderr)
    results = [bench_model(alias, args) for alias in args.models.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "machine": facts, "results": results}
    (out / "plain_decode.json").write_text(json.dumps(report, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
