"""`specdecode bench`: its flags (the method grammar in its help is generated:
`bench/method_help.py`) and its command (run, or re-read a saved report)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode.bench.harness import LoopConfig
from specdecode.bench.method_help import methods_help
from specdecode.bench.presets import BENCH_DEFAULTS, BENCH_PRESETS, as_flags, bench_options
from specdecode.cli_args import add_weight_flags, csv, require_prompt_files, show_progress
from specdecode.corpus.prompts import available_sets
from specdecode.errors import UserError


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode bench`."""
    presets = "; ".join(f"{name} = {as_flags(o)}" for name, o in BENCH_PRESETS.items())
    p = sub.add_parser(
        "bench",
        help="benchmark methods side by side, interleaved, vs plain decoding",
        description="Runs every method on every prompt, interleaved per prompt and repeat, and "
        "reports the speedup vs plain decoding, acceptance, tau, latency and exactness\n"
        "(docs/benchmarks.md); writes bench.json, bench.md and plots into --out.",
        epilog=methods_help(available_sets(), presets),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default = BENCH_DEFAULTS
    p.add_argument("--model", help="target: alias, Hugging Face folder or .gguf file")
    p.add_argument(
        "--preset",
        choices=sorted(BENCH_PRESETS),
        help="a named set of the options below (see Presets below); flags given still win",
    )
    p.add_argument(
        "--methods", help=f"comma-separated method specs (default: {default['methods']})"
    )
    p.add_argument(
        "--prompts", type=csv, help=f"prompt sets (default: {','.join(default['prompts'])})"
    )
    p.add_argument("--per-set", type=int, default=3, help="prompts taken from each set")
    p.add_argument(
        "--max-tokens",
        type=int,
        help=f"new tokens per request at most (default: {default['max_tokens']})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help=f"timed runs of every method and prompt (default: {default['repeats']})",
    )
    add_weight_flags(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampled runs")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        help="always generate --max-tokens (default: stop at EOS)",
    )
    p.add_argument("--retries", type=int, default=2, help="redo a group disturbed by others")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="max s to wait for quiet")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for JSON + md")
    p.add_argument(
        "--report",
        type=Path,
        help="re-read a saved bench.json: recompute its statistics, re-print, redraw its plots",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar or run lines (the bar shows only when stderr is a terminal)",
    )


def run_bench_command(args: argparse.Namespace) -> int:
    """`specdecode bench`: run the methods and print the report, or re-read a saved one."""
    from specdecode.bench.report import markdown
    from specdecode.bench.run import BenchConfig, resummarize, run_bench, save

    if args.report is not None:
        if not args.report.exists():
            raise UserError(f"cannot read the saved report: no such file: {args.report}")
        try:
            saved = json.loads(args.report.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"cannot read the saved report {args.report}: {err}") from err
        report = resummarize(saved)
        print(markdown(report), end="")
        _plots(report, args.report.parent)
        return 0
    if not args.model:
        raise UserError("bench needs --model (or --report FILE to re-print a saved run)")
    args = bench_options(args)
    if args.repeats < 1 or args.retries < 0 or args.max_tokens < 1:
        raise UserError("bench needs --repeats >= 1, --retries >= 0 and --max-tokens >= 1")
    require_prompt_files(args.prompts)
    bar = show_progress(args.no_progress)
    loop = LoopConfig(args.repeats, args.retries, args.quiet_wait, bar)
    config = BenchConfig(
        model=args.model,
        methods=args.methods,
        prompt_sets=args.prompts,
        per_set=args.per_set,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        device=args.device,
        quantization=args.quantization,
        loop=loop,
    )
    report = run_bench(config, log=not args.no_progress)
    save(report, args.out)
    print(markdown(report), end="")
    print(f"raw runs: {args.out / 'bench.json'}", file=sys.stderr)
    _plots(report, args.out)
    return 0


def _plots(report: dict[str, object], out: Path) -> None:
    """Draw the report's plots into `out`, or say why they were skipped (no matplotlib)."""
    from specdecode.bench.plots import plot_all

    try:
        paths = plot_all(report, out)
    except ImportError as err:
        print(f"plots skipped: {err}", file=sys.stderr)
        return
    print(f"plots: {', '.join(str(p) for p in paths)}", file=sys.stderr)
