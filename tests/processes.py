"""Running a child Python process the way the tests need one: a fresh interpreter in the
repository root, with none of the developer's GUARDRAILS_* variables and no inherited
prometheus multiprocess directory (a test that wants one passes it in `extra`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "child_env", "run_python"]

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
