"""Time-bounded reporting (`reporting.report_interval_s`): a guarded step's counts and events
reach the counters and the logs within the interval, with no other guarded call, no `poll()`
and `every_calls` far above the number of calls (else they would wait for traffic forever).

Waits here are bounded generously (the machines are shared): what is asserted is that the
counts arrive with nothing else happening, not how fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

import guardrails as gr
from guardrails.testing import inject_
from tests.instances import instances
from tests.processes import ROOT, child_env
from tests.system.fork_workload import child_status

POLLER = "guardrails-report-poller"
NEVER = 1_000_000  # every_calls: no tick in these tests
LOGITS = "sampler.logits"
NAN = "guardrails_nonfinite_values_total"


class Events:
    """A host logger that records guardrails' events (thread-safe: the poller logs)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __getattr__(self, level: str) -> Callable[..., None]:
        def log(event: str, **fields: Any) -> None:
            with self._lock:
                self.seen.append((event, fields))

        return log

    def named(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [fields for event, fields in self.seen if event == name]


def eventually(read: Callable[[], Any], want: Any, timeout_s: float = 20.0) -> Any:
    """`read()` once it equals `want`, or its last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    got = read()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.02)
        got = read()
    return got


def pollers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == POLLER]


@pytest.fixture
def make(registry: CollectorRegistry) -> Iterator[Callable[..., gr.Guardrails]]:
    with instances(registry=registry) as fresh:

        def build(interval: float = 0.1, **kwargs: Any) -> gr.Guardrails:
            return fresh(reporting={"every_calls": NEVER, "report_interval_s": interval}, **kwargs)

        yield build


def dirty(rows: int = 4, vocab: int = 16) -> torch.Tensor:
    logits = torch.randn(rows, vocab)
    inject_(logits, rows=(1,), kind="nan", count=3)
    return logits


def test_an_idle_sites_counts_and_event_arrive_within_the_interval(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    events = Events()
    guards = make(logger=events)
    site = guards.site(LOGITS)
    for _ in range(3):
        site(dirty())
    # Nothing else happens now: no call, no poll, no tick (every_calls is a million).

    def nan_values() -> float | None:
        return registry.get_sample_value(
            "guardrails_nonfinite_values_total", {"site": LOGITS, "kind": "nan", "rank": "0"}
        )

    assert eventually(nan_values, 9.0) == 9.0
    calls = {"site": LOGITS, "rank": "0"}
    assert registry.get_sample_value("guardrails_guard_calls_total", calls) == 3.0
    logged = eventually(lambda: len(events.named("guardrails.nonfinite_logits")), 1)
    assert logged == 1
    assert events.named("guardrails.nonfinite_logits")[0]["nan_total"] == 9


def test_a_nan_that_raised_under_async_assert_arrives_while_clean_calls_follow(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    """On the CPU the first call's assert raises, so it is not counted as a call; every clean
    call after it is proved clean by the one-sum check. The NaN it counted still reaches the
    counter within the interval (the first counted call starts the poller, clean or not)."""
    site = make(async_assert=True).site(LOGITS)
    with pytest.raises(RuntimeError):
        site(dirty())
    clean = torch.randn(4, 16)

    def nan_values() -> float | None:
        site(clean)
        return registry.get_sample_value(
            "guardrails_nonfinite_values_total", {"site": LOGITS, "kind": "nan", "rank": "0"}
        )

    assert eventually(nan_values, 3.0) == 3.0


def test_without_the_poller_the_same_counts_wait_for_traffic(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    """The control: an interval far longer than the test, the same calls, nothing arrives
    (so the test above can fail)."""
    site = make(interval=3600.0).site(LOGITS)
    for _ in range(3):
        site(dirty())
    time.sleep(0.5)
    calls = {"site": LOGITS, "rank": "0"}
    assert registry.get_sample_value("guardrails_guard_calls_total", calls) == 0.0


def test_the_poller_starts_with_the_first_guarded_call_and_stops_at_close(
    make: Callable[..., gr.Guardrails],
) -> None:
    before = len(pollers())
    guards = make()
    site = guards.site(LOGITS)
    assert len(pollers()) == before  # a process that never samples gets no thread
    site(torch.randn(2, 8))
    assert len(pollers()) == before + 1
    guards.close()
    assert len(pollers()) == before


def test_a_disabled_guardrails_starts_no_poller(make: Callable[..., gr.Guardrails]) -> None:
    before = len(pollers())
    site = make(enabled=False).site(LOGITS)
    site(torch.randn(2, 8))
    assert len(pollers()) == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forks_during_background_polls_leave_every_child_able_to_report(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    """The poller polls every millisecond while the test forks: no child inherits a lock
    (guardrails' or prometheus-client's) that a poll held at the fork, and each child's own
    poller brings its own call's counts (no flush, no tick: its calls go on from the
    parent's count, so only the poller can)."""
    guards = make(interval=0.002)
    site = guards.site(LOGITS)
    site(dirty())
    labels = {"site": LOGITS, "kind": "nan", "rank": "0"}
    assert eventually(lambda: registry.get_sample_value(NAN, labels), 3.0) == 3.0
    statuses = []
    for _ in range(20):
        pid = os.fork()
        if pid == 0:  # the child: one more poisoned call, reported by the child's poller
            code = 1
            try:
                site(dirty())
                got = eventually(lambda: registry.get_sample_value(NAN, labels), 6.0, 5.0)
                code = 0 if got == 6.0 else 3
            finally:
                os._exit(code)
        statuses.append(child_status(pid, 30.0))
    assert statuses == [0] * 20


def test_an_interval_beyond_the_platforms_longest_wait_is_kept_safely(
    make: Callable[..., gr.Guardrails],
) -> None:
    """1e300 s is valid (finite, > 0): the poller waits the longest the platform can."""
    before = len(pollers())
    guards = make(interval=1e300)
    guards.site(LOGITS)(torch.randn(2, 8))
    time.sleep(0.1)
    assert len(pollers()) == before + 1  # alive, not dead of an OverflowError
    guards.close()
    assert len(pollers()) == before


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "2s"])
def test_a_bad_interval_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_REPORT_INTERVAL_S"):
        gr.GuardSettings(environ={"GUARDRAILS_REPORT_INTERVAL_S": value})


# A child that guards 3 poisoned calls, says so, then idles until its stdin closes; its
# interval and every_calls come from the environment, as under `guardrails run`.
CHILD = r"""
import sys, torch
import guardrails as gr
guards = gr.Guardrails()
site = guards.site("sampler.logits")
for _ in range(3):
    logits = torch.randn(4, 16)
    logits[1, :2] = float("nan")
    site(logits)
print("guarded", flush=True)
sys.stdin.read()
"""


def test_a_child_processs_counts_reach_the_tree_while_it_idles(tmp_path: Path) -> None:
    """A real child process in prometheus multiprocess mode (as vLLM's and SGLang's workers
    run): its counts reach the tree's files while it is alive and idle; its exit flush keeps
    them exact."""
    tree = tmp_path / "tree"
    tree.mkdir()
    env = child_env(
        PROMETHEUS_MULTIPROC_DIR=str(tree),
        GUARDRAILS_REPORT_EVERY=str(NEVER),
        GUARDRAILS_REPORT_INTERVAL_S="0.2",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    labels = {"site": LOGITS, "kind": "nan", "rank": "0"}

    def nan_values() -> float | None:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tree))
        return registry.get_sample_value("guardrails_nonfinite_values_total", labels)

    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "guarded"
        assert eventually(nan_values, 6.0) == 6.0
        assert proc.poll() is None  # still alive: the poll, not the exit flush, wrote them
        _out, err = proc.communicate("", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert nan_values() == 6.0
