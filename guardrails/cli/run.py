"""`guardrails run [--config FILE] -- COMMAND ...`: run COMMAND with guardrails installed in it
and in every Python process it starts.

The settings COMMAND will read are validated first; a bad value exits 2 with the message and
nothing is started. Then this process becomes COMMAND (exec): its exit status and signals are
COMMAND's own. 127: command not found; 126: not executable.
"""

from __future__ import annotations

import argparse
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
    from guardrails.integrations.launcher import launch, own_metrics_dir, prepare

    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("guardrails run: no command given (guardrails run -- COMMAND ...)", file=sys.stderr)
        return 2
    env, _ = prepare(os.environ, config_file=args.config)  # ConfigError: exit 2, nothing runs
    env = own_metrics_dir(env)
    try:
        launch(argv, env)
    except FileNotFoundError:
        print(f"guardrails run: {argv[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"guardrails run: {argv[0]}: permission denied", file=sys.stderr)
        return 126
