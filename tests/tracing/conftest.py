from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import guardrails as gr
from guardrails.testing import fresh_guardrails


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def make(registry: CollectorRegistry) -> Iterator[Callable[..., gr.Guardrails]]:
    """Fresh instances on the test's registry, reporting at every site call."""
    made: list[gr.Guardrails] = []

    def build(**settings: Any) -> gr.Guardrails:
        settings.setdefault("reporting", {"every_calls": 1})
        instance = fresh_guardrails(registry=registry, **settings)
        made.append(instance)
        return instance

    yield build
    for instance in made:
        instance.close()
