"""deploy/grafana/guardrails.json: a well-formed dashboard whose every query parses and reads
only metrics the library exports.

Structure: valid JSON, a Prometheus datasource variable used by every panel, target and
query variable, unique panel ids, grid positions inside the 24-column grid without overlaps,
every template variable a query uses defined. Queries: template variables substituted, then
checked by the real `promtool check rules` as recording rules of a temporary file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.promql import KNOWN_METRICS, label_problems, metric_names, promtool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "guardrails.json"

DATASOURCE = "${datasource}"
GRID_COLUMNS = 24
# Grafana's built-in interval variables, replaced by durations promtool accepts.
BUILTIN_DURATIONS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?(\w+)\s*\)\s*$", re.DOTALL)


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _variables() -> list[dict[str, Any]]:
    return list(_dashboard()["templating"]["list"])


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query")
    return str(query.get("query", "") if isinstance(query, dict) else query or "")


def _queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL expression) for every panel target and query variable."""
    for panel in _panels(_dashboard()["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {panel.get('title')!r} {target['refId']}", target["expr"]
    for variable in _variables():
        if variable["type"] != "query":
            continue
        match = _LABEL_VALUES.match(_variable_query(variable))
        assert match, f"variable {variable['name']}: expected label_values(selector, label)"
        if match.group(1):
            yield f"variable {variable['name']}", match.group(1)


def _substitute(expr: str, defined: set[str]) -> str:
    """`expr` with Grafana variables replaced; an undefined variable raises KeyError."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name in BUILTIN_DURATIONS:
            return BUILTIN_DURATIONS[name]
        if name not in defined:
            raise KeyError(name)
        return ".*"  # every dashboard variable is used inside a regex matcher

    return _VARIABLE.sub(value, expr)


def _defined() -> set[str]:
    return {variable["name"] for variable in _variables()}


# -- structure -------------------------------------------------------------------------------


def test_dashboard_is_json_with_uid_title_and_schema_version() -> None:
    data = _dashboard()
    assert data["uid"] == "guardrails"
    assert data["title"]
    assert isinstance(data["schemaVersion"], int)


def test_dashboard_has_a_prometheus_datasource_variable() -> None:
    sources = [v for v in _variables() if v["type"] == "datasource"]
    assert [(v["name"], v["query"]) for v in sources] == [("datasource", "prometheus")]


def test_every_panel_target_and_query_variable_uses_the_datasource_variable() -> None:
    for panel in _panels(_dashboard()["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, panel["id"]
        assert panel.get("targets"), f"panel {panel['id']} has no query"
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"]
    for variable in _variables():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == DATASOURCE, variable["name"]


def test_site_and_rank_variables_select_from_guardrails_series() -> None:
    queries = {v["name"]: _variable_query(v) for v in _variables() if v["type"] == "query"}
    for name in ("site", "rank"):
        match = _LABEL_VALUES.match(queries.get(name, ""))
        assert match, f"no label_values query variable {name!r}"
        assert match.group(2) == name
        assert metric_names(match.group(1) or "") <= KNOWN_METRICS.keys()


def test_panel_ids_are_unique() -> None:
    ids = [panel["id"] for panel in _panels(_dashboard()["panels"])]
    assert len(ids) == len(set(ids)), sorted(ids)


def test_panels_fit_the_grid_without_overlapping() -> None:
    boxes: list[tuple[int, tuple[int, int, int, int]]] = []
    for panel in _panels(_dashboard()["panels"]):
        pos = panel["gridPos"]
        x, y, w, h = pos["x"], pos["y"], pos["w"], pos["h"]
        assert min(x, y) >= 0, f"panel {panel['id']} has a negative position"
        assert min(w, h) >= 1, f"panel {panel['id']} has no area"
        assert x + w <= GRID_COLUMNS, f"panel {panel['id']} runs past column {GRID_COLUMNS}"
        for other_id, (ox, oy, ow, oh) in boxes:
            overlap = x < ox + ow and ox < x + w and y < oy + oh and oy < y + h
            assert not overlap, f"panels {other_id} and {panel['id']} overlap"
        boxes.append((panel["id"], (x, y, w, h)))


def test_rate_panels_break_down_by_site_kind_reason_and_rank() -> None:
    groupings: set[str] = set()
    for _, expr in _queries():
        for labels in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            groupings.update(label.strip() for label in labels.split(","))
    assert groupings >= {"site", "kind", "reason", "rank"}


def test_queries_use_only_defined_template_variables() -> None:
    defined = _defined()
    for where, expr in _queries():
        try:
            substituted = _substitute(expr, defined)
        except KeyError as exc:
            pytest.fail(f"{where}: undefined template variable ${exc.args[0]}")
        assert "$" not in substituted, f"{where}: unrecognised variable syntax in {expr!r}"


# -- metrics and PromQL ----------------------------------------------------------------------


def test_dashboard_uses_only_known_metrics_and_shows_each() -> None:
    used: set[str] = set()
    for where, expr in _queries():
        names = metric_names(_substitute(expr, _defined()))
        assert names, f"{where}: selects no metric"
        unknown = names - KNOWN_METRICS.keys()
        assert not unknown, f"{where}: unknown metrics {sorted(unknown)}"
        used |= names
    assert used == KNOWN_METRICS.keys()


def test_queries_match_and_group_only_labels_their_metrics_carry() -> None:
    for where, expr in _queries():
        problems = label_problems(_substitute(expr, _defined()))
        assert not problems, f"{where}: {problems}"


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    defined = _defined()
    queries = list(_queries())
    rules = [
        {"record": f"dashboard_query_{n}", "expr": _substitute(expr, defined)}
        for n, (_, expr) in enumerate(queries)
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8"
    )
    result = promtool("check", "rules", "--lint=none", path)
    legend = "\n".join(f"dashboard_query_{n}: {where}" for n, (where, _) in enumerate(queries))
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n{legend}"
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout
