"""`guardrails run [--config FILE] -- COMMAND ...`: run COMMAND with guardrails installed in it
and in every Python process it starts.

The settings COMMAND will read are validated first; a bad value (or a GUARDRAILS_METRICS_PORT
that cannot be served) exits 2 with the message and nothing is started. Then the tree's keeper
starts (`guardrails.integrations.tree_keeper`) and this process becomes COMMAND (exec): its
exit status and signals are COMMAND's own. 127: command not found; 126: found but not
executable (permission, exec format, a path through a file), in one line as a shell says it;
the keeper is gone before either returns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="run a command with guardrails installed in every Python process it starts",
        description="Run COMMAND with guardrails installed in it and in every Python process "
        "it starts, using GUARDRAILS_* and the config file (its [[attach]] entries say what "
        "to guard). Example: guardrails run --config config/profiles/vllm.toml -- vllm serve M",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config file for the command (sets GUARDRAILS_CONFIG_FILE for it)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from guardrails.integrations.launcher import launch, own_tree, prepare

    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("guardrails run: no command given (guardrails run -- COMMAND ...)", file=sys.stderr)
        return 2
    env, settings = prepare(os.environ, config_file=args.config)  # ConfigError: exit 2
    env, keeper = own_tree(env, settings)  # a port it cannot serve: ConfigError, exit 2
    # Leaving this block means exec failed: the keeper ends (and cleans up) before we return.
    with keeper or contextlib.nullcontext():
        try:
            launch(argv, env)
        except FileNotFoundError:
            print(f"guardrails run: {argv[0]}: command not found", file=sys.stderr)
            return 127
        except PermissionError:
            print(f"guardrails run: {argv[0]}: permission denied", file=sys.stderr)
            return 126
        except OSError as exc:  # Exec format error, Not a directory, ...: as a shell says
            print(f"guardrails run: {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 126
