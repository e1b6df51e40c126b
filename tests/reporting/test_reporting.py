"""Reporting: exported counter samples, throttled structlog events, faults, start-up rules.

Every test builds its own `CollectorRegistry` and asserts on exported samples; log events are
captured with `structlog.testing.capture_logs`; the throttle runs on an injected clock.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from prometheus_client import REGISTRY, CollectorRegistry
from structlog.testing import capture_logs

import guardrails as gr
from guardrails.testing import fresh_guardrails, inject_
from tests.instances import instances

ROOT = Path(__file__).resolve().parents[2]
LOGITS = "sampler.logits"
IDS = "sampler.token_ids"
EVENT_FIELDS = {"site", "rank", "rows", "calls", "calls_total", "dtype", "shape", "suppressed"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(registry: CollectorRegistry, clock: Clock) -> Iterator[Callable[..., gr.Guardrails]]:
    """Fresh instances on the test's registry and clock, reporting on every call by default."""
    reporting = {"every_calls": 1, "log_interval_s": 60}
    with instances(registry=registry, clock=clock, reporting=reporting) as build:
        yield build


def value(registry: CollectorRegistry, metric: str, **labels: str) -> float | None:
    return registry.get_sample_value(metric, {"rank": "0", **labels})


def nans(registry: CollectorRegistry, site: str = LOGITS) -> float | None:
    return value(registry, "guardrails_nonfinite_values_total", site=site, kind="nan")


def dirty(rows: int = 4, vocab: int = 16, *, nan_rows: tuple[int, ...] = (0,)) -> torch.Tensor:
    logits = torch.randn(rows, vocab)
    inject_(logits, rows=nan_rows, kind="nan", count=2)
    return logits


def events(logs: list[dict[str, Any]], name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"].startswith("guardrails.") and name in (None, e["event"])]


# -- series --------------------------------------------------------------------------------


def test_every_enabled_series_exists_at_zero_once_a_site_is_made(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    guards.site(LOGITS)
    guards.token_site(IDS, vocab_size=10)
    found = {
        (s.name, tuple(sorted(s.labels.items())))
        for m in registry.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.value == 0
    }
    expected = (
        {
            ("guardrails_nonfinite_values_total", (("kind", k), ("rank", "0"), ("site", LOGITS)))
            for k in ("nan", "posinf")
        }
        | {
            ("guardrails_flagged_rows_total", (("rank", "0"), ("reason", r), ("site", s)))
            for s, r in ((LOGITS, "nonfinite"), (LOGITS, "no_valid_token"), (IDS, "oob_token"))
        }
        | {("guardrails_guard_calls_total", (("rank", "0"), ("site", s))) for s in (LOGITS, IDS)}
        | {
            ("guardrails_reporting_errors_total", (("rank", "0"), ("stage", stage)))
            for stage in ("poll", "metrics", "logs")
        }
    )
    assert found == expected


def test_neginf_series_exists_only_where_neginf_is_counted(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make(sites={"model.logits": {"count_neginf": True}})
    guards.site("model.logits")
    guards.site(LOGITS)
    kind = {"kind": "neginf"}
    metric = "guardrails_nonfinite_values_total"
    assert value(registry, metric, site="model.logits", **kind) == 0
    assert value(registry, metric, site=LOGITS, **kind) is None


def test_disabled_site_exports_no_series(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make(disabled_sites=("eagle.draft",))
    guards.site("eagle.draft")(dirty())
    guards.poll()
    sites = {s.labels.get("site") for m in registry.collect() for s in m.samples}
    assert "eagle.draft" not in sites


def test_metric_names_carry_no_colons(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    make().site(LOGITS)
    names = {s.name for m in registry.collect() for s in m.samples}
    assert names
    assert not any(":" in name for name in names)


# -- counts --------------------------------------------------------------------------------


def test_counters_equal_the_exact_counts_after_poll(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    site = guards.site(LOGITS)
    for rows in ([0], [1, 2], [3]):
        logits = torch.randn(4, 16)
        logits[rows, :3] = math.nan
        logits[rows, 5] = math.inf
        site(logits)
    guards.poll()
    metric = "guardrails_nonfinite_values_total"
    assert value(registry, metric, site=LOGITS, kind="nan") == 12
    assert value(registry, metric, site=LOGITS, kind="posinf") == 4
    assert value(registry, "guardrails_flagged_rows_total", site=LOGITS, reason="nonfinite") == 4
    assert value(registry, "guardrails_guard_calls_total", site=LOGITS) == 3


def test_row_with_no_valid_token_is_counted_as_such(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    logits = torch.randn(3, 8)
    inject_(logits, rows=[1], kind="neginf", count="all")
    guards.site(LOGITS)(logits)
    guards.poll()
    reason = "no_valid_token"
    assert value(registry, "guardrails_flagged_rows_total", site=LOGITS, reason=reason) == 1


def test_out_of_vocab_ids_are_counted_per_row(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    guards.token_site(IDS, vocab_size=10)(torch.tensor([[1, 11, 12], [2, 3, 4], [-1, 0, 0]]))
    guards.poll()
    assert value(registry, "guardrails_flagged_rows_total", site=IDS, reason="oob_token") == 2


def test_counts_below_every_calls_wait_for_the_next_report(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make(reporting={"every_calls": 4})
    site = guards.site(LOGITS)
    for _ in range(3):
        site(dirty())
    assert nans(registry) == 0
    site(dirty())
    assert nans(registry) == 8


def test_close_flushes_exact_totals_below_every_calls(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make(reporting={"every_calls": 1000})
    site = guards.site(LOGITS)
    for _ in range(5):
        site(dirty())
    guards.close()
    assert nans(registry) == 10
    assert value(registry, "guardrails_guard_calls_total", site=LOGITS) == 5


def test_closed_instance_reports_no_more(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    site = guards.site(LOGITS)
    guards.close()
    site(dirty())
    guards.poll()
    assert nans(registry) == 0


def test_instances_sharing_a_registry_share_its_counters(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    first, second = make(), make()
    first.site(LOGITS)(dirty())
    second.site(LOGITS)(dirty())
    first.poll()
    second.poll()
    assert nans(registry) == 4


def test_instances_on_the_default_registry_never_collide() -> None:
    site = "default.registry.logits"
    before = REGISTRY.get_sample_value(
        "guardrails_nonfinite_values_total", {"site": site, "kind": "nan", "rank": "0"}
    )
    instances = [gr.Guardrails(gr.GuardSettings(environ={})) for _ in range(2)]
    try:
        for guards in instances:
            guards.site(site)(dirty())
    finally:
        for guards in instances:
            guards.close()
    after = REGISTRY.get_sample_value(
        "guardrails_nonfinite_values_total", {"site": site, "kind": "nan", "rank": "0"}
    )
    assert (after or 0) - (before or 0) == 4


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, "0"),
        ({"RANK": "3"}, "3"),
        ({"LOCAL_RANK": "2"}, "2"),
        ({"RANK": "x", "LOCAL_RANK": "1"}, "1"),
    ],
)
def test_rank_label_comes_from_rank_then_local_rank(
    make: Callable[..., gr.Guardrails],
    registry: CollectorRegistry,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    rank: str,
) -> None:
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, raw in env.items():
        monkeypatch.setenv(key, raw)
    make().site(LOGITS)
    labels = {"site": LOGITS, "rank": rank}
    assert registry.get_sample_value("guardrails_guard_calls_total", labels) == 0


def test_rank_label_prefers_torch_distributed(
    make: Callable[..., gr.Guardrails],
    registry: CollectorRegistry,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    monkeypatch.setenv("RANK", "5")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        make().site(LOGITS)
    finally:
        dist.destroy_process_group()
    assert (
        registry.get_sample_value("guardrails_guard_calls_total", {"site": LOGITS, "rank": "0"})
        == 0
    )
    assert (
        registry.get_sample_value("guardrails_guard_calls_total", {"site": LOGITS, "rank": "5"})
        is None
    )


# -- log events ----------------------------------------------------------------------------


def test_first_hit_is_logged_at_once(make: Callable[..., gr.Guardrails]) -> None:
    site = make().site(LOGITS)
    with capture_logs() as logs:
        site(dirty())
    [event] = events(logs)
    assert event["event"] == "guardrails.nonfinite_logits"
    assert (event["nan"], event["nan_total"], event["rows"], event["suppressed"]) == (2, 2, 1, 0)


def test_clean_calls_log_nothing(make: Callable[..., gr.Guardrails]) -> None:
    site = make().site(LOGITS)
    with capture_logs() as logs:
        for _ in range(5):
            site(torch.randn(4, 16))
    assert events(logs) == []


def test_hits_within_the_interval_are_suppressed_and_counted(
    make: Callable[..., gr.Guardrails], clock: Clock
) -> None:
    site = make().site(LOGITS)
    with capture_logs() as logs:
        for _ in range(5):
            site(dirty())
            clock.now += 1
        clock.now += 60
        site(dirty())
    first, second = events(logs)
    assert first["suppressed"] == 0
    assert second["suppressed"] == 4
    assert (second["nan"], second["nan_total"], second["calls"]) == (10, 12, 5)


def test_counters_stay_exact_while_logs_are_throttled(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    site = make().site(LOGITS)
    with capture_logs() as logs:
        for _ in range(20):
            site(dirty())
    assert len(events(logs)) == 1
    assert nans(registry) == 40


def test_held_back_hits_are_logged_once_the_interval_ends(
    make: Callable[..., gr.Guardrails], clock: Clock
) -> None:
    guards = make()
    site = guards.site(LOGITS)
    with capture_logs() as logs:
        site(dirty())
        site(dirty())
        clock.now += 61
        guards.poll()
    assert [(e["nan"], e["suppressed"]) for e in events(logs)] == [(2, 0), (2, 1)]


def test_close_logs_what_the_throttle_held_back(make: Callable[..., gr.Guardrails]) -> None:
    guards = make()
    site = guards.site(LOGITS)
    with capture_logs() as logs:
        for _ in range(3):
            site(dirty())
        guards.close()
    assert [(e["nan"], e["nan_total"], e["suppressed"]) for e in events(logs)] == [
        (2, 2, 0),
        (4, 6, 2),
    ]


def test_event_reported_only_at_close_names_dtype_and_shape(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make(reporting={"every_calls": 1000})
    guards.site(LOGITS)(dirty(rows=3, vocab=8).to(torch.bfloat16))
    with capture_logs() as logs:
        guards.close()
    [event] = events(logs)
    assert (event["dtype"], event["shape"]) == ("bfloat16", [3, 8])


def test_throttle_is_per_site(make: Callable[..., gr.Guardrails]) -> None:
    guards = make()
    with capture_logs() as logs:
        guards.site(LOGITS)(dirty())
        guards.site("eagle.verify")(dirty())
    assert [e["site"] for e in events(logs)] == [LOGITS, "eagle.verify"]


def test_events_carry_counts_and_metadata_never_values(make: Callable[..., gr.Guardrails]) -> None:
    site = make().site(LOGITS)
    with capture_logs() as logs:
        site(dirty(rows=2, vocab=8).half())
    [event] = events(logs)
    kinds = {"nan", "posinf", "neginf", "rows_nonfinite", "rows_no_valid_token"}
    counts = kinds | {f"{k}_total" for k in kinds}
    assert set(event) == EVENT_FIELDS | counts | {"event", "log_level"}
    assert all(isinstance(event[k], int) for k in counts | {"rows", "calls", "suppressed"})
    assert (event["site"], event["rank"], event["dtype"], event["shape"]) == (
        LOGITS,
        "0",
        "float16",
        [2, 8],
    )


def test_row_with_no_valid_token_logs_its_own_event(make: Callable[..., gr.Guardrails]) -> None:
    site = make().site(LOGITS)
    logits = torch.randn(3, 8)
    inject_(logits, rows=[2], kind="nan", count="all")
    with capture_logs() as logs:
        site(logits)
    [event] = events(logs)
    assert (event["event"], event["log_level"], event["rows"]) == (
        "guardrails.no_valid_token",
        "error",
        1,
    )


def test_out_of_vocab_ids_log_an_oob_event(make: Callable[..., gr.Guardrails]) -> None:
    site = make().token_site(IDS, vocab_size=10)
    with capture_logs() as logs:
        site(torch.tensor([3, 10, 99, 4]))
    [event] = events(logs)
    assert event["event"] == "guardrails.oob_token_ids"
    assert (event["oob_token"], event["rows"], event["vocab_size"]) == (2, 2, 10)


# -- faults --------------------------------------------------------------------------------


class BrokenLogger:
    """Raises on every guardrails event except the report of its own failure."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        raise RuntimeError("log sink is down")

    def error(self, event: str, **fields: Any) -> None:
        if event != "guardrails.reporting_error":
            raise RuntimeError("log sink is down")
        self.errors.append({"event": event, **fields})


def test_logging_fault_never_reaches_the_guarded_call(registry: CollectorRegistry) -> None:
    logger = BrokenLogger()
    guards = fresh_guardrails(registry=registry, logger=logger, reporting={"every_calls": 1})
    site = guards.site(LOGITS)
    flags = site(dirty())
    guards.close()
    assert flags is not None
    assert value(registry, "guardrails_reporting_errors_total", stage="logs") >= 1


def test_logging_fault_is_counted_each_time_and_logged_once(registry: CollectorRegistry) -> None:
    logger = BrokenLogger()
    clock = Clock()
    guards = fresh_guardrails(
        registry=registry, logger=logger, clock=clock, reporting={"every_calls": 1}
    )
    site = guards.site(LOGITS)
    for _ in range(3):
        site(dirty())
        clock.now += 61
    guards.close()
    assert value(registry, "guardrails_reporting_errors_total", stage="logs") == 3
    assert [(e["stage"], e["error"]) for e in logger.errors] == [
        ("logs", "RuntimeError: log sink is down")
    ]


def test_counters_stay_exact_while_logging_fails(registry: CollectorRegistry) -> None:
    guards = fresh_guardrails(
        registry=registry, logger=BrokenLogger(), reporting={"every_calls": 1}
    )
    site = guards.site(LOGITS)
    for _ in range(3):
        site(dirty())
    guards.close()
    assert nans(registry) == 6


def test_metrics_fault_is_contained_and_the_counter_catches_up(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guardrails.reporting.metrics import guard_metrics

    guards = make()
    site = guards.site(LOGITS)
    child = guard_metrics(registry).nonfinite_values.labels(site=LOGITS, kind="nan", rank="0")

    def broken(amount: float = 1) -> None:
        raise OSError("multiprocess directory is full")

    with monkeypatch.context() as patch:
        patch.setattr(child, "inc", broken)
        site(dirty())
        site(dirty())
    assert nans(registry) == 0
    assert value(registry, "guardrails_reporting_errors_total", stage="metrics") == 2
    site(dirty())
    assert nans(registry) == 6


def test_unreadable_counts_are_contained(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    guards = make()
    site = guards.site(LOGITS, device="cpu")
    [counts] = site.device_counts()

    def broken(self: object) -> list[int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(type(counts), "latest", broken)
    flags = site(dirty())
    assert flags is not None
    assert value(registry, "guardrails_reporting_errors_total", stage="poll") == 1


# -- start-up and package rules -----------------------------------------------------------


def test_importing_guardrails_does_not_import_prometheus_client() -> None:
    code = "import sys, guardrails; print('prometheus_client' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


@pytest.fixture
def unconfigured_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.mark.usefixtures("unconfigured_structlog")
def test_json_helper_writes_one_json_object_per_line(
    registry: CollectorRegistry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gr.configure_json_logs() is True
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1})
    guards.site(LOGITS)(dirty())
    guards.close()
    records = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert [r["event"] for r in records] == ["guardrails.started", "guardrails.nonfinite_logits"]
    record = records[1]
    assert (record["event"], record["site"], record["nan"], record["level"]) == (
        "guardrails.nonfinite_logits",
        LOGITS,
        2,
        "warning",
    )


@pytest.mark.usefixtures("unconfigured_structlog")
def test_json_helper_leaves_a_configured_host_alone() -> None:
    processors = [structlog.processors.KeyValueRenderer()]
    structlog.configure(processors=processors)
    assert gr.configure_json_logs() is False
    assert structlog.get_config()["processors"] == processors


@pytest.mark.usefixtures("unconfigured_structlog")
def test_json_log_format_setting_configures_an_unconfigured_host(
    registry: CollectorRegistry,
) -> None:
    guards = fresh_guardrails(registry=registry, reporting={"log_format": "json"})
    guards.close()
    renderer = structlog.get_config()["processors"][-1]
    assert isinstance(renderer, structlog.processors.JSONRenderer)


@pytest.mark.usefixtures("unconfigured_structlog")
def test_host_log_format_leaves_structlog_unconfigured(registry: CollectorRegistry) -> None:
    fresh_guardrails(registry=registry).close()
    assert not structlog.is_configured()
