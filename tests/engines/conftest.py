"""Shared by the real-engine suites (`make engines`; never collected by `make test`).

Each suite runs inside its engine's own venv (`.ci/engines/build.sh`), named by ENGINE_SUITE
(for example `sglang-0.5.23`). `outcome` records what one case observed, unguarded and
guarded, into ENGINE_RESULTS (JSON lines); `python -m tests.engines.summary` prints the table
of every suite's records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

ENGINE = os.environ.get("ENGINE_SUITE", "")
# The class-level suites drive guardrails instances of their own: guardrails' plugin entry
# point (installed with it in each engine venv) must not install the shipped profile on top
# if engine code loads its plugins. The engines' own allowlists leave it out (SGLang reads an
# empty SGLANG_PLUGINS as "all": it names another plugin). test_plugin.py in each engine's
# suite loads it through the engine's own loader, in a child process.
# Only in an engine suite (ENGINE_SUITE set): `make test` imports this file too, and must not
# see these.
if ENGINE:
    os.environ["VLLM_PLUGINS"] = ""
    os.environ["SGLANG_PLUGINS"] = "not-guardrails"


def engine_version() -> tuple[str, str]:
    """(engine, version) of the venv this suite runs in, from ENGINE_SUITE."""
    name, _, version = ENGINE.partition("-")
    return name, version


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Iterator[None]:
    """Undo a test's structlog configuration (`structlog.testing.capture_logs` leaves structlog
    configured): guardrails' events then go to structlog, so a later test reading the stdlib
    logger `guardrails` (caplog) would see nothing. Each test starts as the suite started."""
    configured = structlog.is_configured()
    yield
    if not configured and structlog.is_configured():
        structlog.reset_defaults()


@pytest.fixture
def outcome() -> Callable[..., None]:
    """`outcome(component=, dtype=, mode=, fault=, unguarded=, guarded=)`: one table row."""
    path = os.environ.get("ENGINE_RESULTS")

    def record(
        *, component: str, dtype: str, mode: str, fault: str, unguarded: str, guarded: str
    ) -> None:
        if not path:
            return
        engine, version = engine_version()
        row = {
            "engine": engine,
            "version": version,
            "component": component,
            "dtype": dtype,
            "mode": mode,
            "fault": fault,
            "unguarded": unguarded,
            "guarded": guarded,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")

    return record
