from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

import guardrails as gr
from tests.instances import instances


@pytest.fixture
def make(registry: CollectorRegistry) -> Iterator[Callable[..., gr.Guardrails]]:
    """Fresh instances on the test's registry, reporting at every site call."""
    with instances(registry=registry, reporting={"every_calls": 1}) as build:
        yield build
