"""What the deploy tests share: the paths of the deploy assets, the metrics the library
exports (`KNOWN_METRICS`, the one list the deploy assets may use), the real promtool, and a
small PromQL reader that finds the metric names and labels an expression uses.

promtool is a real dependency: the tests that run it skip without it locally, and fail under
CI (`CI` set), where .ci/run installs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from guardrails.reporting.metrics import METRIC_LABELS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "guardrails.rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "guardrails.rules.test.yml"

# The metrics the library exports and the labels each carries (ARCHITECTURE.md, Reporting),
# read from the code that defines the counters: a renamed metric or label fails these tests.
KNOWN_METRICS: Mapping[str, frozenset[str]] = {
    name: frozenset(labels) for name, labels in METRIC_LABELS.items()
}
# Labels the scrape adds to every series (Prometheus and the PodMonitor's target labels).
TARGET_LABELS = frozenset({"namespace", "job", "instance", "pod", "container", "endpoint"})


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real promtool; skip without it locally, fail without it in CI."""
    exe = shutil.which("promtool") or (
        "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None
    )
    if exe is None:
        message = (
            "promtool not found on PATH or at /usr/bin/promtool "
            "(Debian: apt-get install prometheus; .ci/run installs it)"
        )
        if os.environ.get("CI"):
            pytest.fail(message + " -- required in CI")
        pytest.skip(message)
    return subprocess.run(
        [exe, *map(str, args)], capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )


_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_TOKEN = re.compile(
    r"(?P<number>(?:0x[0-9a-fA-F]+|\d[\d.]*(?:[eE][+-]?\d+)?)[a-zA-Z]*)"
    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?"
)
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
        "atan2",
    }
)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (identifiers that are not calls or keywords).

    Not a parser, but enough for the expressions in deploy/: label matchers, range and
    subquery brackets, grouping clauses, strings and numbers are removed before looking.
    """
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names: set[str] = set()
    for match in _TOKEN.finditer(text):
        ident = match.group("ident")
        if ident is None or match.group("call") or ident.lower() in _KEYWORDS:
            continue
        names.add(ident)
    return names


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUP_LABELS = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", re.IGNORECASE
)


def label_problems(expr: str) -> list[str]:
    """Labels `expr` matches on or groups by that none of its known metrics carries."""
    text = _STRING.sub('""', expr)
    problems = []
    for metric, body in _SELECTOR.findall(text):
        allowed = KNOWN_METRICS.get(metric, frozenset()) | TARGET_LABELS
        for label in _MATCHER_LABEL.findall(body):
            if label not in allowed:
                problems.append(f"{metric} has no label {label!r}")
    available = set(TARGET_LABELS).union(
        *(KNOWN_METRICS.get(name, frozenset()) for name in metric_names(expr))
    )
    for group in _GROUP_LABELS.findall(text):
        for label in filter(None, (part.strip() for part in group.split(","))):
            if label not in available:
                problems.append(f"no metric in the expression has label {label!r}")
    return problems


def load_rules() -> dict[str, Any]:
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{RULES}: not a mapping"
    return data


def rules_of(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in data["groups"]:
        yield from group["rules"]
