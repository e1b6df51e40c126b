"""guardrails' series on SGLang's own /metrics (`--enable-metrics`), in SGLang's process tree.

`metrics_tree_workload.py` runs SGLang's own `set_prometheus_multiproc_dir()`, its tokenizer
manager's metrics collector, a scheduler process started with multiprocessing spawn and
`add_prometheus_middleware`'s /metrics, once plain and once under `guardrails run` with the
SGLang profile. Guarded, SGLang's main-process series (made after the directory was set) are
still on its /metrics, unchanged, and the scheduler's NaN counts are there too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engines.sglang.engine import NEW, PROFILE, ROOT, V
from tests.engines.sglang.test_profile import child_env

BIN = Path(sys.executable).parent
WORKLOAD = Path(__file__).with_name("metrics_tree_workload.py")
# SGLang's main-process prompt-token series; 0.5.14 added the is_streaming label.
PROMPT_TOKENS = (
    ("sglang:prompt_tokens_total", (("is_streaming", "false"), ("model_name", "m")))
    if NEW
    else ("sglang:prompt_tokens_total", (("model_name", "m"),))
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def run(tmp_path: Path, *, guarded: bool) -> dict[str, Any]:
    out = tmp_path / ("guarded.json" if guarded else "plain.json")
    command = [sys.executable, str(WORKLOAD), str(out)]
    if guarded:
        command = [str(BIN / "guardrails"), "run", "--config", str(PROFILE), "--", *command]
    env = child_env(GUARDRAILS_REPORT_EVERY="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["status"] == 200
    assert result["exitcodes"] == [0], done.stderr[-4000:]
    return result


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], dict[str, Any]]:
    seen: dict[bool, dict[str, Any]] = {}

    def scrape(guarded: bool) -> dict[str, Any]:
        if guarded not in seen:
            seen[guarded] = run(tmp_path_factory.mktemp("sglang-metrics"), guarded=guarded)
        return seen[guarded]

    return scrape


def test_a_main_process_sglang_metric_is_on_sglangs_metrics_under_guardrails_run(  # type: ignore[no-untyped-def]
    scrapes, outcome
) -> None:
    plain = samples(scrapes(False)["scrape"])
    result = scrapes(True)
    guarded = samples(result["scrape"])
    assert plain[PROMPT_TOKENS] == 7.0
    assert guarded.get(PROMPT_TOKENS) == 7.0
    assert result["imported_at_start"] is False  # the bootstrap left prometheus_client alone
    # Nothing of SGLang's lost or altered.
    sglangs = {k: v for k, v in plain.items() if not k[0].startswith("guardrails_")}
    assert {k: guarded.get(k) for k in sglangs} == sglangs
    outcome(
        component="/metrics (add_prometheus_middleware), main process",
        dtype="float32",
        mode="greedy",
        fault="none: SGLang's own tokenizer series",
        unguarded="sglang:prompt_tokens_total 7 on /metrics",
        guarded="sglang:prompt_tokens_total 7 on /metrics (before: missing, the bootstrap "
        "imported prometheus_client first)",
    )


def test_the_schedulers_nan_counts_are_on_sglangs_metrics(scrapes, outcome) -> None:  # type: ignore[no-untyped-def]
    plain = samples(scrapes(False)["scrape"])
    guarded = samples(scrapes(True)["scrape"])
    key = (
        "guardrails_nonfinite_values_total",
        (("kind", "nan"), ("rank", "0"), ("site", "sampler.logits")),
    )
    assert key not in plain
    assert guarded[key] == V  # the all-NaN row, counted in the scheduler process
    rows = (
        "guardrails_flagged_rows_total",
        (("rank", "0"), ("reason", "no_valid_token"), ("site", "sampler.logits")),
    )
    assert guarded[rows] == 1.0
    outcome(
        component="/metrics (add_prometheus_middleware), scheduler process",
        dtype="float32",
        mode="greedy",
        fault="all-NaN row in a spawned scheduler",
        unguarded="no guardrails series",
        guarded=f"guardrails_nonfinite_values_total{{kind=nan}} {guarded[key]:.0f}",
    )
