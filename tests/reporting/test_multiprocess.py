"""prometheus-client multiprocess mode, as SGLang and vLLM run it.

Worker processes started with PROMETHEUS_MULTIPROC_DIR each guard injected tensors; the
parent aggregates their files with a `MultiProcessCollector`, exactly as an engine's /metrics
endpoint does, and must see the exact totals per site and rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # seconds each: `pytest -m 'not slow'` skips them

# argv: every_calls, calls, nan values per call, "close" or "exit", "serve" or "done"
WORKER = r"""
import math, sys
import torch
import guardrails as gr

every, calls, nan = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": every}))
logits_site = guards.site("sampler.logits")
ids_site = guards.token_site("sampler.token_ids", vocab_size=10)
for step in range(calls):
    logits = torch.randn(4, 16)
    logits[1, :nan] = math.nan
    logits_site(logits)
    ids_site(torch.tensor([1, 10 + step % 3, 2]))
if sys.argv[4] == "close":
    guards.close()
if sys.argv[5] == "serve":
    print("ready", flush=True)
    sys.stdin.read()
"""


def worker_env(multiproc_dir: Path, rank: int, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GUARDRAILS_") and k not in ("RANK", "LOCAL_RANK")
    }
    env.update(PROMETHEUS_MULTIPROC_DIR=str(multiproc_dir), RANK=str(rank), **extra)
    return env


def start(env: Mapping[str, str], *args: object, serve: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", WORKER, *(str(a) for a in args), "serve" if serve else "done"]
    return subprocess.Popen(
        argv,
        env=dict(env),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> None:
    try:
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def aggregate(multiproc_dir: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))
    return registry


@pytest.fixture
def multiproc_dir(tmp_path: Path) -> Path:
    path = tmp_path / "prometheus-multiproc"
    path.mkdir()
    return path


def test_parent_scrape_shows_exact_totals_per_site_and_rank(multiproc_dir: Path) -> None:
    # (rank, calls, NaN per call): two processes share rank 1, and their counts add up.
    workers = [(0, 7, 2), (1, 5, 3), (1, 4, 1)]
    procs = [
        start(worker_env(multiproc_dir, r), 3, calls, nan, "close") for r, calls, nan in workers
    ]
    for proc in procs:
        finish(proc)
    registry = aggregate(multiproc_dir)

    def total(metric: str, **labels: str) -> float | None:
        return registry.get_sample_value(metric, labels)

    nan_metric = "guardrails_nonfinite_values_total"
    assert total(nan_metric, site="sampler.logits", kind="nan", rank="0") == 14
    assert total(nan_metric, site="sampler.logits", kind="nan", rank="1") == 19
    for rank, calls in (("0", 7), ("1", 9)):
        oob = {"site": "sampler.token_ids", "reason": "oob_token", "rank": rank}
        assert total("guardrails_flagged_rows_total", **oob) == calls
        for site in ("sampler.logits", "sampler.token_ids"):
            assert total("guardrails_guard_calls_total", site=site, rank=rank) == calls


def test_interpreter_exit_flushes_pending_counts(multiproc_dir: Path) -> None:
    # every_calls far above the number of calls, and no close(): only the exit hook reports.
    finish(start(worker_env(multiproc_dir, 0), 1000, 5, 2, "exit"))
    registry = aggregate(multiproc_dir)
    labels = {"site": "sampler.logits", "kind": "nan", "rank": "0"}
    assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 10


def test_metrics_server_serves_every_process_in_multiprocess_mode(multiproc_dir: Path) -> None:
    finish(start(worker_env(multiproc_dir, 0), 1, 3, 2, "close"))
    port = free_port()
    env = worker_env(multiproc_dir, 1, GUARDRAILS_METRICS_PORT=str(port))
    server = start(env, 1, 2, 1, "exit", serve=True)
    try:
        assert server.stdout is not None
        # Skip whatever the worker printed before "ready" (its events go to stderr).
        lines = iter(server.stdout.readline, "")
        assert "ready" in (line.strip() for line in lines)
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.kill()
        server.wait()
    nans = {
        sample.labels["rank"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "guardrails_nonfinite_values_total" and sample.labels["kind"] == "nan"
    }
    assert nans == {"0": 6.0, "1": 2.0}


def _scrape_nans(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.labels["rank"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "guardrails_nonfinite_values_total" and sample.labels["kind"] == "nan"
    }


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, ""):
        if line.strip() == "ready":
            return
    raise AssertionError(f"worker exited before serving: {proc.communicate()[1]}")


def test_workers_sharing_a_metrics_port_are_served_by_the_first(multiproc_dir: Path) -> None:
    # Every worker of a multiprocess engine inherits GUARDRAILS_METRICS_PORT: the first binds
    # it, the others find it served by a sibling and start anyway.
    port = free_port()
    procs = [
        start(
            worker_env(multiproc_dir, rank, GUARDRAILS_METRICS_PORT=str(port)),
            1,
            2,
            nan,
            "exit",
            serve=True,
        )
        for rank, nan in ((0, 3), (1, 1))
    ]
    try:
        for proc in procs:
            _wait_ready(proc)
        assert _scrape_nans(port) == {"0": 6.0, "1": 2.0}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_foreign_process_on_the_port_is_still_an_error_in_multiprocess_mode(
    multiproc_dir: Path,
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = worker_env(multiproc_dir, 0, GUARDRAILS_METRICS_PORT=str(port))
        proc = start(env, 1, 1, 1, "close")
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "GUARDRAILS_METRICS_PORT" in err
    assert "cannot serve metrics" in err


FORKED = r"""
import math, os, sys
import torch
import guardrails as gr

guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1000}))
site = guards.site("sampler.logits")
logits = torch.randn(2, 8)
logits[0, :3] = math.nan
site(logits)  # counted before the fork, not yet reported
pid = os.fork()
if pid == 0:
    logits = torch.randn(2, 8)
    logits[1, :2] = math.nan
    site(logits)
    guards.close()
    os._exit(0)
_, status = os.waitpid(pid, 0)
guards.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_reports_only_its_own_calls(multiproc_dir: Path) -> None:
    # A fork-started engine worker inherits its parent's sites: the parent reports what it
    # counted before the fork, the child only what it counts after, nothing twice.
    env = worker_env(multiproc_dir, 0, GUARDRAILS_METRICS_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "-c", FORKED], env=env, cwd=ROOT, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    registry = aggregate(multiproc_dir)
    labels = {"site": "sampler.logits", "rank": "0"}
    assert registry.get_sample_value("guardrails_guard_calls_total", labels) == 2
    nan = {**labels, "kind": "nan"}
    assert registry.get_sample_value("guardrails_nonfinite_values_total", nan) == 5


FORKED_HOST_TIME = r"""
import os, sys
import prometheus_client  # the host's own: guardrails' series open in multiprocess mode
import guardrails as gr

guards = gr.Guardrails(gr.GuardSettings())
guards.host_time.add("test:parent", 0.5)  # spent before the fork, not yet reported
pid = os.fork()
if pid == 0:
    guards.host_time.add("test:child", 0.25)
    guards.close()
    os._exit(0)
_, status = os.waitpid(pid, 0)
guards.host_time.add("test:parent", 0.125)
guards.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_counts_only_its_own_host_time(multiproc_dir: Path) -> None:
    # The parent's seconds spent before the fork are the parent's to report: summed over the
    # processes' files, nothing is counted twice.
    env = worker_env(multiproc_dir, 0)
    done = subprocess.run(
        [sys.executable, "-c", FORKED_HOST_TIME],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    registry = aggregate(multiproc_dir)
    host = "guardrails_host_seconds_total"
    assert registry.get_sample_value(host, {"part": "test:parent", "rank": "0"}) == 0.625
    assert registry.get_sample_value(host, {"part": "test:child", "rank": "0"}) == 0.25


def test_constant_labels_reach_the_engines_endpoint_per_worker(multiproc_dir: Path) -> None:
    # vLLM and SGLang label their own series model_name / engine / tp_rank; each worker is
    # told its own through GUARDRAILS_METRICS_LABELS, and the engine's collector (no extra
    # port) shows guardrails' series beside its own with the same labels.
    workers = [(0, "tp_rank=0"), (1, "tp_rank=1")]
    procs = [
        start(
            worker_env(multiproc_dir, rank, GUARDRAILS_METRICS_LABELS=f"model_name=tiny, {labels}"),
            2,
            3,
            rank + 1,
            "close",
        )
        for rank, labels in workers
    ]
    for proc in procs:
        finish(proc)
    registry = aggregate(multiproc_dir)
    for rank in (0, 1):
        labels = {
            "site": "sampler.logits",
            "kind": "nan",
            "rank": str(rank),
            "model_name": "tiny",
            "tp_rank": str(rank),
        }
        assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 3 * (
            rank + 1
        )
