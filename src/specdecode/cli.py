"""`specdecode` command line: registers every subcommand and dispatches to it.

Each subcommand's flags and run live beside its code: generate, chat, models, pull, certify and
env in `specdecode.commands`, bench and plan in `specdecode.bench`, train in `specdecode.train.cli`,
serve in `specdecode.server.cli`. Bad input is one line on stderr and exit code 2: a flag
argparse refuses (`OneLineParser`) or a `UserError` from the command; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from specdecode.bench.cli import add_bench_parser, run_bench_command
from specdecode.bench.plan_cli import add_plan_parser, run_plan_command
from specdecode.cli_args import BAD_INPUT, OneLineParser
from specdecode.commands.certify import add_certify_parser, run_certify
from specdecode.commands.chat import add_chat_parser, run_chat
from specdecode.commands.env import add_env_parser, run_env
from specdecode.commands.generate import add_generate_parser, run_generate
from specdecode.commands.models import add_models_parser, add_pull_parser, run_models, run_pull
from specdecode.errors import UserError
from specdecode.server.cli import add_serve_parser, run_serve
from specdecode.train.cli import add_train_parser, run_train

Register = Callable[[argparse._SubParsersAction], None]
Run = Callable[[argparse.Namespace], int]

# subcommand -> (register its parser, run it), in the order `--help` lists them
COMMANDS: dict[str, tuple[Register, Run]] = {
    "models": (add_models_parser, run_models),
    "pull": (add_pull_parser, run_pull),
    "generate": (add_generate_parser, run_generate),
    "chat": (add_chat_parser, run_chat),
    "bench": (add_bench_parser, run_bench_command),
    "plan": (add_plan_parser, run_plan_command),
    "certify": (add_certify_parser, run_certify),
    "train": (add_train_parser, run_train),
    "serve": (add_serve_parser, run_serve),
    "env": (add_env_parser, run_env),
}


def build_parser() -> argparse.ArgumentParser:
    """The `specdecode` parser with every subcommand of COMMANDS."""
    parser = OneLineParser(
        prog="specdecode", description="Lossless speculative decoding for causal language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register, _ in COMMANDS.values():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit code (2: bad input, said in one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except UserError as err:  # anything else is a bug: its traceback is kept
        print(f"specdecode: error: {err}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
