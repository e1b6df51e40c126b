"""guardrails' series in a real process tree under `guardrails run`, and on one port.

The tree is `tests/reporting/tree_workload.py`: the command itself and children started with
multiprocessing's spawn context, each running the bootstrap. Process i guards 2**i NaN values
under rank i, so one scrape that holds every rank's exact count holds every process's.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from guardrails import ConfigError
from guardrails.testing import fresh_guardrails
from tests.processes import ROOT, child_env

pytestmark = pytest.mark.slow  # a process tree each: seconds

RUN = [sys.executable, "-m", "guardrails", "run", "--"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_tree(*args: str, **env: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [*RUN, sys.executable, "-m", "tests.reporting.tree_workload", *args],
        env=child_env(PYTHONPATH=str(ROOT), GUARDRAILS_REPORT_EVERY="1", **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def nan_by_rank(text: str) -> dict[str, float]:
    found = samples(text, "guardrails_nonfinite_values_total")
    return {
        dict(labels)["rank"]: value
        for labels, value in found.items()
        if dict(labels)["kind"] == "nan" and dict(labels)["site"] == "sampler.logits"
    }


def test_the_trees_keeper_serves_the_port_with_every_processs_counts() -> None:
    port = free_port()
    result, done = run_tree(
        "port", "2", GUARDRAILS_METRICS_PORT=str(port), GUARDRAILS_LOG_FORMAT="json"
    )
    assert result["alive_at_scrape"] == [True, True]
    assert result["exitcodes"] == [0, 0]
    # Served by the process the marker names, which is none of the tree's guarded processes.
    assert result["listening"] == [False, False, False]
    assert result["marked_listening"] is True
    assert result["marked_in_tree"] is False
    assert nan_by_rank(result["scrape"]) == {"0": 1.0, "1": 2.0, "2": 4.0}
    calls = samples(result["scrape"], "guardrails_guard_calls_total")
    assert sorted(calls.values()) == [1.0, 1.0, 1.0]
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    started = [e for e in events if e["event"] == "guardrails.started"]
    elsewhere = [e for e in events if e["event"] == "guardrails.metrics_served_elsewhere"]
    # Every process of the tree (the command, the children, multiprocessing's resource
    # tracker) says so once.
    assert len(started) >= 3
    assert len(elsewhere) == len(started), done.stderr[-4000:]
    assert not [e for e in events if e["level"] == "error"], done.stderr[-4000:]


def test_the_hosts_registry_shows_the_childs_series_next_to_its_own_unchanged() -> None:
    result, _done = run_tree("registry")
    assert result["imported_at_start"] is False  # the bootstrap left it to the host
    assert result["exitcodes"] == [0]
    assert result["multiprocess_mode"] is False  # the host's choice, untouched
    text = result["scrape"]
    assert nan_by_rank(text) == {"1": 2.0}
    # The host's own counter as a single-process registry exports it, _created included.
    assert samples(text, "host_requests_total") == {(("route", "/v1"),): 3.0}
    assert samples(text, "host_requests_created")


# The host chooses multiprocess mode after interpreter start, as SGLang and vLLM's several API
# servers do: set the directory, then import prometheus_client. A counter the host makes then
# must be a multiprocess one (in the host's files), guardrails' own too.
HOST_CHOOSES_LATE = r"""
import json, math, os, sys, tempfile
start = "prometheus_client" in sys.modules
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
from prometheus_client import CollectorRegistry, Counter, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
Counter("host_tokens", "The host's counter.").inc(5)
import torch
from guardrails.integrations.launcher import installed
x = torch.zeros(1, 8); x[0, :3] = math.nan
installed().site("sampler.logits")(x)
served = CollectorRegistry(); MultiProcessCollector(served)
print(json.dumps({"start": start, "multiprocess": values.ValueClass._multiprocess,
                  "scrape": generate_latest(served).decode()}))
"""


def launched(code: str) -> dict[str, Any]:
    """The JSON that `code` prints last, run under `guardrails run` (counts at every call)."""
    done = subprocess.run(
        [*RUN, sys.executable, "-c", code],
        env=child_env(PYTHONPATH=str(ROOT), GUARDRAILS_REPORT_EVERY="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_host_choosing_multiprocess_mode_after_start_gets_it(tmp_path: Path) -> None:
    result = launched(HOST_CHOOSES_LATE)
    assert result["start"] is False
    assert result["multiprocess"] is True
    assert samples(result["scrape"], "host_tokens_total") == {(): 5.0}
    assert nan_by_rank(result["scrape"]) == {"0": 3.0}


# SGLang's HTTP server process: the sampler module is imported (an attach point applies and
# makes its site) before launch_server sets PROMETHEUS_MULTIPROC_DIR and imports
# prometheus_client; that process never samples. Making the site must not import
# prometheus_client (it fixed single-process mode, and the host's own counters then never
# reached its multiprocess /metrics); the first guarded call may.
SITE_MADE_BEFORE_THE_HOST_CHOSE = r"""
import json, math, os, sys, tempfile
from guardrails.integrations.launcher import installed
import torch
site = installed().site("sampler.logits")  # made, never called (yet)
made = "prometheus_client" in sys.modules
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
from prometheus_client import CollectorRegistry, Counter, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
Counter("host_requests", "The host's counter.").inc(2)
x = torch.zeros(1, 8); x[0, :3] = math.nan
site(x)
served = CollectorRegistry(); MultiProcessCollector(served)
print(json.dumps({"made": made, "multiprocess": values.ValueClass._multiprocess,
                  "scrape": generate_latest(served).decode()}))
"""


def test_a_site_made_before_the_host_chooses_its_mode_leaves_the_choice_to_it() -> None:
    result = launched(SITE_MADE_BEFORE_THE_HOST_CHOSE)
    assert result["made"] is False
    assert result["multiprocess"] is True
    assert samples(result["scrape"], "host_requests_total") == {(): 2.0}
    assert nan_by_rank(result["scrape"]) == {"0": 3.0}


def test_a_metrics_dir_the_operator_set_is_left_in_place(tmp_path: Path) -> None:
    code = "import os; print(os.environ['GUARDRAILS_METRICS_DIR'])"
    done = subprocess.run(
        [*RUN, sys.executable, "-c", code],
        env=child_env(PYTHONPATH=str(ROOT), GUARDRAILS_METRICS_DIR=str(tmp_path)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path)
    assert tmp_path.is_dir()


# -- two instances in one process, one port --------------------------------------------------


def test_two_instances_with_their_own_registries_on_one_port_fail_at_construction() -> None:
    port = free_port()
    env = {"GUARDRAILS_METRICS_PORT": str(port)}
    first = fresh_guardrails(environ=env, registry=CollectorRegistry())
    try:
        with pytest.raises(ConfigError, match="serves a different registry there") as info:
            fresh_guardrails(environ=env, registry=CollectorRegistry())
        assert f"GUARDRAILS_METRICS_PORT={port}" in str(info.value)
    finally:
        first.close()
    # Once the first is closed the port is free for another registry.
    fresh_guardrails(environ=env, registry=CollectorRegistry()).close()


TWO_DEFAULTS = r"""
import json, math, urllib.request
import torch
import guardrails as gr
first = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1}))
second = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1}))
x = torch.zeros(1, 8); x[0, :1] = math.nan
first.site("a.logits")(x)
y = torch.zeros(1, 8); y[0, :2] = math.nan
second.site("b.logits")(y)
port = first.settings.metrics.port
with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
    print(json.dumps(reply.read().decode()))
"""


def test_two_instances_on_the_default_registry_share_the_port_and_both_are_served() -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-c", TWO_DEFAULTS],
        env=child_env(GUARDRAILS_METRICS_PORT=str(port)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    text = json.loads(done.stdout)
    found = samples(text, "guardrails_nonfinite_values_total")
    assert found[(("kind", "nan"), ("rank", "0"), ("site", "a.logits"))] == 1.0
    assert found[(("kind", "nan"), ("rank", "0"), ("site", "b.logits"))] == 2.0


# Counts made before the host imports prometheus_client wait in their series, and the host's
# own import (a post-import hook) is what makes them.
COUNTED_BEFORE_THE_HOST_CHOSE = r"""
import json, sys
import guardrails as gr
guards = gr.Guardrails(gr.GuardSettings())
guards.attach_errors.record(site="sampler.logits", target="engine:sample", error=ValueError("x"))
guards.hook_errors.prepare("sglang.abort_poisoned_requests")
guards.hook_errors.record("sglang.abort_poisoned_requests", "Sampler.forward", KeyError("k"),
                          log=False)
before = "prometheus_client" in sys.modules
from prometheus_client import REGISTRY
attach = REGISTRY.get_sample_value("guardrails_attach_errors_total",
    {"site": "sampler.logits", "target": "engine:sample", "rank": "0"})
hooks = REGISTRY.get_sample_value("guardrails_hook_errors_total",
    {"hook": "sglang.abort_poisoned_requests", "rank": "0"})
print(json.dumps({"before": before, "attach": attach, "hooks": hooks}))
"""


def test_counts_made_before_the_host_imports_prometheus_client_arrive_when_it_does() -> None:
    done = subprocess.run(
        [sys.executable, "-c", COUNTED_BEFORE_THE_HOST_CHOSE],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"before": False, "attach": 1.0, "hooks": 1.0}
