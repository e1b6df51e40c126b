"""deploy/prometheus: the rules pass promtool's checks and unit tests, and fit the contract.

The metric names, the promtool runner and the PromQL reader are shared with the Grafana and
Kubernetes tests (`tests/deploy/promql.py`); the reader itself is tested here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.promql import (
    KNOWN_METRICS,
    ROOT,
    RULES,
    RULES_TEST,
    label_problems,
    load_rules,
    metric_names,
    promtool,
    rules_of,
)

RUNBOOK = ROOT / "docs" / "runbook.md"
SEVERITIES = frozenset({"warning", "critical"})


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules_of(load_rules()) if "alert" in rule]


def _records() -> list[dict[str, Any]]:
    return [rule for rule in rules_of(load_rules()) if "record" in rule]


def github_anchors(markdown: str) -> set[str]:
    """Anchors GitHub generates for the headings of a Markdown document."""
    anchors: set[str] = set()
    for line in markdown.splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


# -- the PromQL name extractor itself -------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('rate(a_total{site=~"x.y", kind="nan"}[5m])', {"a_total"}),
        (
            "sum by (site, rank) (rate(a_total[5m])) / on (job) group_left (site) b_total",
            {"a_total", "b_total"},
        ),
        ("a > bool 1e30 and b offset 5m unless c:d:rate5m", {"a", "b", "c:d:rate5m"}),
        ('sum(increase(a{l="sum(b)"}[$x]))', {"a"}),
        ("max_over_time(rate(a[5m])[1h:1m]) > 0x1F", {"a"}),
    ],
)
def test_metric_names_finds_selected_metrics_only(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize(
    ("expr", "problems"),
    [
        (
            'sum by (job, site, kind) (rate(guardrails_nonfinite_values_total{rank="0"}[5m]))',
            [],
        ),
        (
            'guardrails_flagged_rows_total{kind="nan"}',
            ["guardrails_flagged_rows_total has no label 'kind'"],
        ),
        (
            "sum by (site, kind) (rate(guardrails_guard_calls_total[5m]))",
            ["no metric in the expression has label 'kind'"],
        ),
    ],
)
def test_label_problems_finds_labels_the_metrics_lack(expr: str, problems: list[str]) -> None:
    assert label_problems(expr) == problems


# -- promtool --------------------------------------------------------------------------------


def test_rules_pass_promtool_check_with_lint() -> None:
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_pass_their_promtool_unit_tests() -> None:
    result = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_catch_an_alert_that_fires_on_one_off_values(
    tmp_path: Path,
) -> None:
    data = load_rules()
    for rule in rules_of(data):
        if rule.get("alert") == "GuardrailsNonfiniteLogits":
            del rule["for"]
    (tmp_path / RULES.name).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    result = promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "GuardrailsNonfiniteLogits" in result.stdout + result.stderr


# -- structure and contract ------------------------------------------------------------------


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    for rule in _alerts():
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        annotations = rule.get("annotations", {})
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert all(str(annotations[key]).strip() for key in annotations), name


def test_every_runbook_url_names_an_existing_runbook_section() -> None:
    anchors = github_anchors(RUNBOOK.read_text(encoding="utf-8"))
    for rule in _alerts():
        url = rule["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == "docs/runbook.md", f"{rule['alert']}: {url}"
        assert anchor == rule["alert"].lower(), f"{rule['alert']}: {url}"
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor} in {RUNBOOK}"


def test_rules_use_only_known_metrics_and_their_own_records() -> None:
    records = {rule["record"] for rule in _records()}
    for rule in rules_of(load_rules()):
        unknown = metric_names(rule["expr"]) - KNOWN_METRICS.keys() - records
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: {sorted(unknown)}"


def test_rules_match_and_group_only_labels_their_metrics_carry() -> None:
    for rule in rules_of(load_rules()):
        problems = label_problems(rule["expr"])
        assert not problems, f"{rule.get('alert') or rule.get('record')}: {problems}"


def test_every_known_metric_feeds_an_alert() -> None:
    used = set().union(*(metric_names(rule["expr"]) for rule in _alerts()))
    assert used >= KNOWN_METRICS.keys(), sorted(KNOWN_METRICS.keys() - used)


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    for rule in _alerts():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case.get("exp_alerts") for case in mine), f"{rule['alert']}: no firing test"
        assert any(not case.get("exp_alerts") for case in mine), f"{rule['alert']}: no silent test"


def test_every_recording_rule_has_a_value_test() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))["tests"]
    tested = {case["expr"] for test in tests for case in test.get("promql_expr_test", [])}
    for rule in _records():
        assert rule["record"] in tested, rule["record"]
