"""Faults around the /metrics server: contained where they are reporting faults, a
`ConfigError` naming the right setting where the configuration is at fault, never a half state.

The multiprocess directory is read by the exposition when the server starts, so most of these
run in-process with PROMETHEUS_MULTIPROC_DIR set for the test (the counters themselves stay in
single-process mode: that mode is fixed when prometheus-client is imported). One test runs a
child process in real multiprocess mode, through the first sampling call.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails import ConfigError
from guardrails.reporting.exposition import listens_on
from guardrails.testing import fresh_guardrails
from tests.processes import child_env, run_python

LOGITS = "sampler.logits"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    """No socket listens on `port` (connections left in TIME_WAIT by a scrape do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def nan_logits() -> torch.Tensor:
    x = torch.zeros(2, 8)
    x[0, :3] = math.nan
    return x


def metrics_errors(registry: CollectorRegistry) -> float | None:
    labels = {"stage": "metrics", "rank": "0"}
    return registry.get_sample_value("guardrails_reporting_errors_total", labels)


def marker(directory: Path, port: int) -> Path:
    return directory / f"guardrails_metrics_{port}.server"


@pytest.fixture
def multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "multiproc"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    return directory


@pytest.fixture
def live_stranger() -> Iterator[int]:
    """The pid of a live process that serves nothing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


# -- a multiprocess "directory" that is a regular file --------------------------------------


def test_multiprocess_path_that_is_a_file_is_a_contained_metrics_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "not-a-directory"
    path.write_text("", encoding="utf-8")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
    registry = CollectorRegistry()
    port = free_port()
    with capture_logs() as logs:
        guards = fresh_guardrails(registry=registry, metrics={"port": port})
    try:
        x = nan_logits()
        assert guards.site(LOGITS)(x).tolist() == [1, 0]
        assert bool((x[0, :3] == -math.inf).all())
        assert metrics_errors(registry) == 1  # counted once the series exist
    finally:
        guards.close()
    [error] = [e for e in logs if e["event"] == "guardrails.reporting_error"]
    assert error["stage"] == "metrics"
    assert "not a directory" in error["error"]
    assert port_is_free(port)  # nothing half-started


FIRST_CALL = r"""
import json, math, sys
import torch
import guardrails as gr

gr.configure_json_logs(sys.stderr)
x = torch.zeros(2, 8)
x[0, :3] = math.nan
flags = gr.sanitize_logits_(x).clone()
y = torch.zeros(2, 8)
y[1, 2] = math.nan
gr.sanitize_logits_(y)
print(json.dumps({"flags": flags.tolist(), "healed": bool((x[0, :3] == -math.inf).all()),
                  "nan": gr.default().count("sampler.logits", "nan")}))
"""


def test_every_sampling_call_survives_a_multiprocess_file_and_a_metrics_port(
    tmp_path: Path,
) -> None:
    path = tmp_path / "not-a-directory"
    path.write_text("", encoding="utf-8")
    env = child_env(PROMETHEUS_MULTIPROC_DIR=str(path), GUARDRAILS_METRICS_PORT=str(free_port()))
    done = run_python("-c", FIRST_CALL, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"flags": [1, 0], "healed": True, "nan": 4}
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    errors = [e for e in events if e["event"] == "guardrails.reporting_error"]
    assert [e["stage"] for e in errors] == ["metrics"]  # logged once, however often it recurs


# -- the sibling marker ---------------------------------------------------------------------


def test_an_unwritable_marker_leaves_the_server_serving_and_is_counted(
    multiproc_dir: Path,
) -> None:
    port = free_port()
    marker(multiproc_dir, port).mkdir()  # stops root too: a directory where the file goes
    registry = CollectorRegistry()
    with capture_logs() as logs:
        guards = fresh_guardrails(registry=registry, metrics={"port": port})
    try:
        guards.site(LOGITS)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
        assert metrics_errors(registry) == 1
    finally:
        guards.close()
    assert [e["stage"] for e in logs if e["event"] == "guardrails.reporting_error"] == ["metrics"]
    assert port_is_free(port)  # and close() stops it: no server left behind
    assert marker(multiproc_dir, port).is_dir()  # what was there is left alone


def test_a_planted_link_at_the_marker_is_replaced_not_followed(multiproc_dir: Path) -> None:
    port = free_port()
    target = multiproc_dir.parent / "precious.txt"
    target.write_text("keep me", encoding="utf-8")
    marker(multiproc_dir, port).symlink_to(target)
    guards = fresh_guardrails(metrics={"port": port})
    try:
        written = marker(multiproc_dir, port)
        assert not written.is_symlink()
        assert json.loads(written.read_text(encoding="ascii")) == {"pid": os.getpid(), "port": port}
    finally:
        guards.close()
    assert target.read_text(encoding="utf-8") == "keep me"
    assert not marker(multiproc_dir, port).exists()  # close() removes its own marker


@pytest.mark.parametrize("form", ["pid", "json"])
def test_a_stale_marker_naming_a_live_pid_does_not_excuse_a_taken_port(
    multiproc_dir: Path, live_stranger: int, form: str
) -> None:
    # "pid": what earlier versions wrote, and believed whenever that pid was alive.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        text = (
            str(live_stranger)
            if form == "pid"
            else json.dumps({"pid": live_stranger, "port": port})
        )
        marker(multiproc_dir, port).write_text(text, encoding="ascii")
        with pytest.raises(ConfigError, match=rf"argument metrics\.port={port}: cannot serve"):
            fresh_guardrails(metrics={"port": port})


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")
def test_listens_on_tells_the_process_holding_a_port(live_stranger: int) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        assert listens_on(os.getpid(), port)
        assert not listens_on(live_stranger, port)
    assert not listens_on(os.getpid(), port)  # closed: no longer listening


# -- the address, not the port ------------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "reason"),
    [
        ("192.0.2.1", "assign requested address"),  # TEST-NET-1: never an address of this host
        ("no-such-host.invalid", ""),  # RFC 2606: never resolves
    ],
)
def test_an_address_that_cannot_be_bound_is_blamed_on_the_address(addr: str, reason: str) -> None:
    port = free_port()
    with pytest.raises(ConfigError) as info:
        fresh_guardrails(metrics={"port": port, "addr": addr})
    [problem] = info.value.problems
    assert problem.where == "argument metrics.addr"
    assert problem.value == addr
    assert reason in problem.message
    assert port_is_free(port)


def test_a_taken_port_is_still_blamed_on_the_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        with pytest.raises(ConfigError) as info:
            fresh_guardrails(environ={"GUARDRAILS_METRICS_PORT": str(port)})
    [problem] = info.value.problems
    assert problem.where == "GUARDRAILS_METRICS_PORT"
