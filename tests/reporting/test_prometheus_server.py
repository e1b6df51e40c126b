"""A real Prometheus server scrapes a process that guards injected NaNs.

Needs the `prometheus` binary (Debian package `prometheus`, which `.ci/run` installs): the
test skips without it locally and fails without it in CI (where `CI` is set).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # seconds each: `pytest -m 'not slow'` skips them
DEADLINE_S = 30.0
CALLS, NAN_PER_CALL = 3, 5

SERVED = r"""
import math, sys
import torch
import guardrails as gr

guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1}))
site = guards.site("sampler.logits")
for _ in range(int(sys.argv[1])):
    logits = torch.randn(4, 32)
    logits[2, : int(sys.argv[2])] = math.nan
    site(logits)
print("ready", flush=True)
sys.stdin.read()
"""


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )
    if found is None:
        message = "the prometheus binary is missing (apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must provide it")
        pytest.skip(message)
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def served_port(tmp_path: Path) -> Iterator[int]:
    """A child process serving its guardrails metrics on a free loopback port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.update(GUARDRAILS_METRICS_PORT=str(port), GUARDRAILS_METRICS_ADDR="127.0.0.1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = (tmp_path / "child.log").open("wb")
    child = subprocess.Popen(
        [sys.executable, "-c", SERVED, str(CALLS), str(NAN_PER_CALL)],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    try:
        assert child.stdout is not None
        lines = iter(child.stdout.readline, b"")
        if b"ready" not in (line.strip() for line in lines):
            pytest.fail(f"child exited early: {(tmp_path / 'child.log').read_text()}")
        yield port
    finally:
        stop(child)
        log.close()


@pytest.fixture
def binary() -> str:
    return prometheus_binary()


@pytest.fixture
def prometheus_url(binary: str, tmp_path: Path, served_port: int) -> Iterator[str]:
    """Prometheus on a free loopback port, scraping the child every second."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: guardrails\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{served_port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    server = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server)
        log.close()


def query(base: str, promql: str) -> list[dict[str, object]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.loads(reply.read())
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def test_prometheus_scrapes_the_exact_nan_count(prometheus_url: str, tmp_path: Path) -> None:
    promql = 'guardrails_nonfinite_values_total{site="sampler.logits",kind="nan",rank="0"}'
    expected = CALLS * NAN_PER_CALL
    seen: object = None
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            result = query(prometheus_url, promql)
        except (urllib.error.URLError, ConnectionError):
            result = []  # still starting
        if result:
            seen = result[0]["value"]
            if float(result[0]["value"][1]) == expected:  # type: ignore[index]
                return
        time.sleep(0.5)
    log = (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:]
    pytest.fail(f"Prometheus never showed {expected} within {DEADLINE_S:g} s (last {seen}):\n{log}")
