"""guardrails' series on vLLM's own /metrics registry, in vLLM's process topology.

`metrics_tree_workload.py` starts vLLM's processes the way vLLM does (engine core through
vLLM's `get_mp_context()`, API servers with the spawn context) and scrapes the API process's
`get_prometheus_registry()`. Each case runs once plain and once under `guardrails run` with
the vLLM profile: the guarded scrape holds the engine core's NaN counts, and every series vLLM
exposes plain is exposed guarded, vLLM's own with the same values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .faults import PROFILE

BIN = Path(sys.executable).parent
ROOT = PROFILE.parents[2]
NAN_COUNT = 3 + 4096  # the workload's NaN entries and all-NaN row

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def run(mode: str, method: str, tmp_path: Path, *, guarded: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(
        PYTHONPATH=str(ROOT),
        VLLM_WORKER_MULTIPROC_METHOD=method,
        GUARDRAILS_REPORT_EVERY="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    out = tmp_path / f"{mode}-{method}-{'guarded' if guarded else 'plain'}.json"
    command = [sys.executable, "-m", "tests.engines.vllm.metrics_tree_workload", mode, str(out)]
    if guarded:
        command = [str(BIN / "guardrails"), "run", "--config", str(PROFILE), "--", *command]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert set(result["exitcodes"]) == {0}, done.stderr[-4000:]
    return result


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def nan_total(found: Samples) -> float:
    return sum(
        value
        for (name, labels), value in found.items()
        if name == "guardrails_nonfinite_values_total"
        and dict(labels).get("kind") == "nan"
        and dict(labels).get("site") == "sampler.logits"
    )


def vllms_own(found: Samples) -> Samples:
    # vLLM's series and their values; `_created` and process-level samples vary by run.
    return {
        key: value
        for key, value in found.items()
        if key[0].startswith("vllm:") and not key[0].endswith("_created")
    }


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Samples]:
    seen: dict[str, Samples] = {}

    def plain(mode: str) -> Samples:
        if mode not in seen:
            result = run(mode, "spawn", tmp_path_factory.mktemp("plain"), guarded=False)
            seen[mode] = samples(result["scrape"])
        return seen[mode]

    return plain


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("mode", ["one", "several"])
def test_the_engine_cores_nan_counts_are_on_vllms_registry_next_to_its_own_series(  # type: ignore[no-untyped-def]
    mode: str, method: str, tmp_path: Path, plain_runs, outcome
) -> None:
    plain = plain_runs(mode)
    guarded = samples(run(mode, method, tmp_path, guarded=True)["scrape"])
    assert nan_total(plain) == 0
    assert nan_total(guarded) == NAN_COUNT
    # Nothing of vLLM's lost or altered: every series of the plain scrape is there, vLLM's own
    # with the same values, and guardrails adds only its own.
    assert vllms_own(plain), "vLLM's stat logger exported nothing: the workload is wrong"
    assert vllms_own(guarded) == vllms_own(plain)
    missing = {key for key in plain if key not in guarded}
    assert not missing, sorted(missing)[:10]
    added = {key[0] for key in guarded if key not in plain}
    assert all(name.startswith("guardrails_") for name in added), sorted(added)
    servers = "one API server" if mode == "one" else "two API servers"
    outcome(
        component=f"/metrics: {servers}, engine core by {method}",
        dtype="float32",
        mode="greedy",
        fault="NaN entries, all-NaN row in the engine core",
        unguarded="no guardrails series on vLLM's registry",
        guarded=f"guardrails_nonfinite_values_total{{kind=nan}} {nan_total(guarded):.0f} "
        "next to vLLM's series, unchanged",
    )
