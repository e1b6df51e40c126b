"""Every guardrails event: named once in `guardrails.names`, listed in EVENT_NAMES and in the
event list of docs/metrics.md, and delivered through the host-logger path (`guardrails.logs`),
never a stdlib logger of a module's own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from guardrails import names
from tests.processes import ROOT

PACKAGE = ROOT / "guardrails"
EVENT_LITERAL = re.compile(r"(guardrails\.[a-z_]+)(?:\s|$)")


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_event_constant_is_in_event_names() -> None:
    constants = {getattr(names, n) for n in dir(names) if n.endswith("_EVENT")}
    assert constants == set(names.EVENT_NAMES)
    assert len(names.EVENT_NAMES) == len(constants)


def test_no_module_spells_an_event_name_of_its_own() -> None:
    # An event written as a literal elsewhere (`_log.warning("guardrails.x ...")`) would
    # escape EVENT_NAMES, the documented event list and the host-logger path. Docstrings may
    # name events.
    found = []
    for path in _sources():
        if path == PACKAGE / "names.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
            ):
                spelled = EVENT_LITERAL.match(node.value)
                if spelled and not _is_module(spelled.group(1)):
                    found.append(f"{path.relative_to(ROOT)}: {node.value[:60]!r}")
    assert not found, found


def _is_module(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_event_is_in_the_documented_event_list() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    logs = text[text.index("\n## Logs\n") :]
    end = logs.find("\n## ", 1)  # the next section, if Logs is not the last
    logs = logs if end < 0 else logs[:end]
    missing = [event for event in names.EVENT_NAMES if f"`{event}`" not in logs]
    assert not missing, missing


def test_only_the_host_logger_touches_the_standard_library_logging() -> None:
    users = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        if path != PACKAGE / "logs.py" and re.search(r"logging\.getLogger|import logging", text):
            users.append(str(path.relative_to(ROOT)))
    assert not users, users
