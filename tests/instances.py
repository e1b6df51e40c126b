"""Fresh `Guardrails` instances for one test, every one closed when it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import guardrails as gr
from guardrails.testing import fresh_guardrails


@contextlib.contextmanager
def instances(**defaults: Any) -> Iterator[Callable[..., gr.Guardrails]]:
    """`build(**settings)` makes `fresh_guardrails(**defaults, **settings)`, a setting given
    replacing its default (a whole `reporting` table replaces the default table); each instance
    built is closed when the block ends."""
    made: list[gr.Guardrails] = []

    def build(**settings: Any) -> gr.Guardrails:
        made.append(fresh_guardrails(**{**defaults, **settings}))
        return made[-1]

    try:
        yield build
    finally:
        for instance in made:
            instance.close()
