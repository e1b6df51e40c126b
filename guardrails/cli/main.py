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


def version() -> str:
    """`guardrails-logits X.Y.Z`: the distribution's version, as installed (importing the
    package would cost torch's import, for one line)."""
    import importlib.metadata

    from guardrails.distribution import DISTRIBUTION

    try:
        return f"{DISTRIBUTION} {importlib.metadata.version(DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{DISTRIBUTION} (not installed: running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guardrails",
        description="Guard LLM sampling against NaN/Inf logits: demo, inspect and run. "
        "Also installed as `guardrails-logits` (another project installs a `guardrails` "
        "command too).",
    )
    parser.add_argument("--version", action="version", version=version())
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
    except KeyboardInterrupt:
        # Ctrl-C ends a command, with the conventional status and no traceback.
        print(f"\nguardrails {args.command}: interrupted", file=sys.stderr)
        return 130
