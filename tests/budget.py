"""Example budgets of the fuzz tests, scaled for the long run.

`RELIABILITY_FUZZ_SCALE` (default 1) multiplies every budget; `make reliability` runs the fuzz
files with it raised (`benchmarks/reliability.py`) and records the case counts in
docs/reliability.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import settings

F = TypeVar("F", bound=Callable[..., Any])

SCALE = float(os.environ.get("RELIABILITY_FUZZ_SCALE", "1"))


def scaled(examples: int) -> int:
    """`examples` in make test, times RELIABILITY_FUZZ_SCALE in the long version."""
    return max(1, round(examples * SCALE))


def budget(examples: int) -> Callable[[F], F]:
    """Hypothesis settings running `scaled(examples)` cases."""
    return settings(max_examples=scaled(examples))
