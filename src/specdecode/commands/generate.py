"""`specdecode generate`: its flags and its command (stream a completion, or print one JSON
object; with --compare, run plain decoding beside it)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from specdecode.cli_args import (
    add_sampling_flags,
    add_speculative_flag,
    add_weight_flags,
    json_object,
    llm_from_args,
    sampling_from_args,
)
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.types import RequestOutput


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode generate`."""
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--model", required=True, help="alias, Hugging Face folder or .gguf file")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="new tokens at most (default 128; prompt + these must fit the model's context)",
    )
    add_sampling_flags(p)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_weight_flags(p)
    add_speculative_flag(p)
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


def run_generate(args: argparse.Namespace) -> int:
    """`specdecode generate`: stream the completion and a summary line, or print one JSON
    object; refuses --max-tokens beyond the model's context as the server does."""
    if args.compare and args.speculative_config is None:
        raise UserError("--compare needs --speculative-config: it compares it with plain decoding")
    params = sampling_from_args(
        args, stop=tuple(args.stop or ()), structured_outputs=args.structured_outputs
    )
    llm = llm_from_args(args)
    prompt: object = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        prompt = llm.chat_prompt(messages)
    check_fits(llm, prompt, args.max_tokens)
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
    line = summary(out, llm.speculative_config is not None)
    print(f"\n[{label}{llm.weight_format}: {line}]", file=sys.stderr)
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


def check_fits(llm: LLM, prompt: object, max_tokens: int) -> None:
    """Refuse a `prompt` (text, or a chat prompt's {"prompt_token_ids": ...}) that fills the
    model's context, or `max_tokens` that do not fit after it, with the server's message
    (`Engine.check_context`)."""
    if isinstance(prompt, dict):
        num_prompt = len(prompt["prompt_token_ids"])
    else:
        num_prompt = len(llm.tokenizer.encode(str(prompt)))
    llm.engine.check_context(num_prompt, max_tokens)


def _result_json(out: RequestOutput) -> dict[str, object]:
    assert out.metrics is not None
    return {
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.outputs[0].finish_reason,
        **out.metrics.as_dict(),  # includes "spec": drafts, acceptance, tau
    }


def summary(out: RequestOutput, speculative: bool) -> str:
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
