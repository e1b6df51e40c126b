"""Running a child Python process the way the tests need one: a fresh interpreter in the
repository root, with none of the developer's GUARDRAILS_* variables and no inherited
prometheus multiprocess directory (a test that wants one passes it in `extra`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "child_env", "json_events", "run_python"]

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without GUARDRAILS_* and PROMETHEUS_MULTIPROC_DIR, plus
    `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(extra)
    return env


def run_python(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python ARGV...` to completion, output captured as text; never raises on its status."""
    return subprocess.run(
        [sys.executable, *argv],
        env=child_env() if env is None else env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def json_events(output: str, event: str | None = None) -> list[dict[str, Any]]:
    """The guardrails events a child logged as JSON lines (`GUARDRAILS_LOG_FORMAT=json`) in
    `output` (its stderr), in order; only those named `event` when given."""
    found = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [e for e in found if event is None or e.get("event") == event]
