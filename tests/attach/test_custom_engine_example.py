"""examples/custom_engine.py, run as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_engine.py"


def test_the_custom_engine_example_runs_and_reports_what_it_guarded() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {
        tuple(line.split()[:2]): line.split()[2]
        for line in proc.stdout.splitlines()
        if line.startswith(("model.logits ", "sampler.logits ", "sampler.token_ids "))
    }
    # 4 steps x 64 NaN in request 1; the sampler site sees 60 (4 ids are masked to -inf).
    assert rows[("model.logits", "nan")] == "256"
    assert rows[("sampler.logits", "nan")] == "240"
    assert rows[("sampler.logits", "rows_no_valid_token")] == "4"
    assert rows[("sampler.token_ids", "oob_token")] == "0"
