"""The `guardrails` command (also `python -m guardrails`).

Each subcommand lives in `guardrails.cli.<name>` and exposes `register(subparsers)`,
which adds its parser and sets `func(args) -> int` as the default. Modules are imported only
when the command line is parsed, so `import guardrails` stays free of CLI dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

COMMANDS: tuple[str, ...] = ("demo", "config", "check", "run", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guardrails",
        description="Guard LLM sampling against NaN/Inf logits: demo, inspect and run.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"guardrails.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from guardrails.exceptions import ConfigError

    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"guardrails: {exc}", file=sys.stderr)
        return 2
