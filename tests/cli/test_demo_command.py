"""The demo serving loop: survives injected faults with guards, crashes without."""

from __future__ import annotations

import subprocess
import sys

from guardrails.cli.demo.loop import DemoConfig, run_demo
from guardrails.testing import fresh_guardrails

SMALL = {"requests": 10, "concurrency": 4, "max_new_tokens": 8, "vocab": 2048, "d_model": 32}


def test_guarded_loop_survives_every_fault_kind() -> None:
    config = DemoConfig(fault_rate=0.25, seed=3, **SMALL)  # type: ignore[arg-type]
    with fresh_guardrails() as guards:
        result = run_demo(config, guards)
        counts = guards.counts()
    assert result.crashed is None
    assert result.finished + result.aborted == config.requests
    assert set(result.injected) == {"overflow", "glitch", "overmask", "oob", "draft"}
    assert counts[("sampler.token_ids", "oob_token")] == result.injected["oob"]
    assert counts[("sampler.logits", "rows_no_valid_token")] >= 1
    # An overflowed row is all NaN, but for the half a grammar mask may have set to -inf.
    assert counts[("sampler.logits", "nan")] >= config.vocab // 2
    assert counts[("eagle.verify", "posinf")] >= 1
    assert result.aborted >= 1


def test_unguarded_loop_crashes_on_the_same_faults() -> None:
    config = DemoConfig(fault_rate=0.25, seed=3, guard=False, **SMALL)  # type: ignore[arg-type]
    result = run_demo(config, None)
    assert result.crashed is not None
    assert "probability tensor" in result.crashed or "index out of range" in result.crashed


def test_demo_command_prints_a_summary() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "guardrails", "demo", "--requests", "6", "--vocab", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokens generated" in proc.stdout
    assert "sampler.token_ids" in proc.stdout
    assert "guard time / step time" in proc.stdout


def test_running_demo_serves_metrics_that_pass_promtool() -> None:
    import os
    import shutil
    import urllib.request

    import pytest
    from prometheus_client.parser import text_string_to_metric_families

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: .ci/run installs Debian's prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    argv = [
        sys.executable,
        "-m",
        "guardrails",
        "demo",
        "--requests",
        "8",
        "--vocab",
        "1024",
        "--fault-rate",
        "0.3",
        "--serve-after",
        "60",
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        url = None
        for line in iter(proc.stdout.readline, ""):
            if line.startswith("metrics: "):
                url = line.split()[1]
            if line.startswith("serving metrics for"):
                break
        assert url is not None, "the demo did not announce its metrics address"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    samples = {
        (s.name, s.labels.get("site"), s.labels.get("kind") or s.labels.get("reason")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("guardrails_guard_calls_total", "sampler.logits", None)] > 0
    assert samples[("guardrails_nonfinite_values_total", "sampler.logits", "nan")] > 0
    assert samples[("guardrails_flagged_rows_total", "sampler.token_ids", "oob_token")] > 0
