"""`guardrails demo` as a newcomer meets it: options out of range are refused by name, it says
when guardrails is off, how long its /metrics lives, and Ctrl-C ends it without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from guardrails.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--requests", "3", "--vocab", "256", "--max-new-tokens", "4")


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("--requests", "0", "must be >= 1; got 0"),
        ("--concurrency", "-2", "must be >= 1; got -2"),
        ("--fault-rate", "2", "must be from 0 to 1; got 2"),
        ("--fault-rate", "nan", "must be from 0 to 1; got nan"),
        ("--fault-rate", "often", "expected a number from 0 to 1; got 'often'"),
        ("--serve-after", "-1", "must be from 0 to 86400; got -1"),
    ],
)
def test_an_option_out_of_range_is_refused_naming_the_range(
    capsys: pytest.CaptureFixture[str], option: str, value: str, accepted: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["demo", option, value])
    assert done.value.code == 2
    assert f"argument {option}: {accepted}" in capsys.readouterr().err


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(extra)
    return env


def run_demo(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "guardrails", "demo", *argv],
        env=demo_env(**env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_demo_says_guardrails_is_off_when_it_is() -> None:
    done = run_demo(*SMALL, GUARDRAILS_ENABLED="false")
    [line] = [line for line in done.stdout.splitlines() if line.startswith("serving ")]
    assert line.endswith("guardrails OFF (GUARDRAILS_ENABLED=false)")
    assert "metrics: " not in done.stdout  # nothing is counted: nothing is served


def test_the_demo_says_its_metrics_end_with_it() -> None:
    done = run_demo(*SMALL)
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("metrics: ")]
    assert line.endswith("/metrics (until the demo ends; --serve-after SECONDS keeps it up)")
    assert done.stdout.splitlines()[1].endswith("guardrails ON")


def test_ctrl_c_ends_the_demo_without_a_traceback() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "guardrails", "demo", "--requests", "100000", "--vocab", "256"],
        env=demo_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            if line.startswith("serving "):
                break
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.rstrip().endswith("guardrails demo: interrupted")
