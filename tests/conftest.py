from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from guardrails.testing import fresh_guardrails, reset_default

# CI runs more cases, derandomized: a red build then means the change broke something, never
# that this run happened to draw a new case. Fresh cases are explored by local runs (the
# default profile is random) and by the long `make reliability` run.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=100
)
settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    max_examples=300,
    derandomize=True,
    database=None,
)
# The long run (`make reliability` sets RELIABILITY_FUZZ_SCALE) explores fresh random cases and
# keeps no example database: a failure it finds is printed whole by its runner, and must not be
# replayed into the next `make test` of the same checkout.
settings.register_profile(
    "reliability",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    max_examples=100,
    database=None,
)
if os.environ.get("RELIABILITY_FUZZ_SCALE"):
    settings.load_profile("reliability")
else:
    settings.load_profile("ci" if os.environ.get("CI") else "default")

HAS_CUDA = torch.cuda.is_available()

# The real-engine suites run only inside their engines' venvs (`make engines` sets
# ENGINE_SUITE), the real-server suite only in its own (`make e2e` sets E2E_SUITE), the release
# suite only against the venv its built wheel went into (`make release` sets RELEASE_VENV);
# `make test` collects none of them.
collect_ignore_glob = [] if os.environ.get("ENGINE_SUITE") else ["engines/*"]
if not os.environ.get("E2E_SUITE"):
    collect_ignore_glob.append("e2e/*")
if not os.environ.get("RELEASE_VENV"):
    collect_ignore_glob.append("release/*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's GUARDRAILS_* variables or a default instance."""
    for key in list(os.environ):
        if key.startswith("GUARDRAILS_"):
            monkeypatch.delenv(key)
    reset_default()


@pytest.fixture
def registry() -> Any:
    """A prometheus-client registry of the test's own (imported here, not at collection:
    prometheus-client fixes its multiprocess mode when first imported)."""
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


@pytest.fixture
def guards():  # type: ignore[no-untyped-def]
    instance = fresh_guardrails()
    yield instance
    instance.close()
