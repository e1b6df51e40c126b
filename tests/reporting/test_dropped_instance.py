"""A `Guardrails` dropped without `close()` still reports its exact totals.

Counts below `every_calls` wait in the device buffer for the next report. An instance the host
forgets (a config reload, a test) is flushed when it is collected, and at interpreter exit if
it is not collected before, so the counters never lose what was counted.
"""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from guardrails.testing import fresh_guardrails
from tests.processes import child_env, run_python

NAN = {"site": "sampler.logits", "kind": "nan", "rank": "0"}
CALLS = {"site": "sampler.logits", "rank": "0"}


def seven_nans() -> torch.Tensor:
    x = torch.randn(2, 16)
    x[1, :7] = math.nan
    return x


def test_a_collected_instance_flushes_its_pending_counts() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1_000_000})
    guards.site("sampler.logits")(seven_nans())
    assert registry.get_sample_value("guardrails_nonfinite_values_total", NAN) == 0
    gone = weakref.ref(guards)
    del guards
    gc.collect()
    assert gone() is None  # collected: nothing keeps a dropped instance alive
    assert registry.get_sample_value("guardrails_nonfinite_values_total", NAN) == 7
    assert registry.get_sample_value("guardrails_guard_calls_total", CALLS) == 1


def test_an_instance_with_nothing_attached_is_freed_and_flushed_when_dropped() -> None:
    # Its parts hold it weakly: no reference cycle waits for the collector.
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1_000_000})
    guards.site("sampler.logits")(seven_nans())
    guards.token_site("sampler.token_ids", vocab_size=16)
    gone = weakref.ref(guards)
    gc.disable()
    try:
        del guards
        assert gone() is None
    finally:
        gc.enable()
    assert registry.get_sample_value("guardrails_nonfinite_values_total", NAN) == 7


CHILD = r"""
import gc, math, sys
import torch
import guardrails as gr

guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1000000}))
site = guards.site("sampler.logits")
x = torch.randn(2, 16)
x[1, :7] = math.nan
site(x)
del guards, site
gc.collect()  # a dropped instance may be collected at any time before exit
"""


def test_an_instance_dropped_before_exit_leaves_exact_counters(tmp_path: Path) -> None:
    directory = tmp_path / "multiproc"
    directory.mkdir()
    env = child_env(PROMETHEUS_MULTIPROC_DIR=str(directory), RANK="0")
    done = run_python("-c", CHILD, env=env)
    assert done.returncode == 0, done.stderr
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    assert registry.get_sample_value("guardrails_nonfinite_values_total", NAN) == 7
    assert registry.get_sample_value("guardrails_guard_calls_total", CALLS) == 1


def test_a_closed_instance_is_not_flushed_again_when_collected() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1_000_000})
    site = guards.site("sampler.logits")
    site(seven_nans())
    guards.close()
    site(seven_nans())  # after close: not reported, by contract
    del guards
    gc.collect()
    assert registry.get_sample_value("guardrails_nonfinite_values_total", NAN) == 7
