"""Helpers for tests, in this project and in the projects that embed guardrails.

    from guardrails.testing import fresh_guardrails, inject_
    guards = fresh_guardrails(sanitize=False)      # ignores the process environment
    n = inject_(logits, rows=[0, 3], kind="nan")   # returns how many values were written

Nothing here is imported by `import guardrails`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from guardrails.logs import SilentLogger
from guardrails.service import Guardrails, _reset_default
from guardrails.settings import GuardSettings

__all__ = ["SilentLogger", "fresh_guardrails", "inject_", "reset_default"]

_VALUES = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf}


def fresh_guardrails(
    *,
    environ: Mapping[str, str] | None = None,
    registry: Any = None,
    clock: Callable[[], float] | None = None,
    logger: Any = None,
    **settings: Any,
) -> Guardrails:
    """A new `Guardrails` that reads only `environ` (default: nothing) and `settings`.

    `registry` defaults to a new prometheus `CollectorRegistry`, so counters never leak
    between tests.
    """
    if registry is None:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
    config = GuardSettings(environ={} if environ is None else environ, **settings)
    kwargs: dict[str, Any] = {"registry": registry, "logger": logger}
    if clock is not None:
        kwargs["clock"] = clock
    return Guardrails(config, **kwargs)


def inject_(
    logits: torch.Tensor,
    *,
    rows: Iterable[int],
    kind: Literal["nan", "posinf", "neginf"] = "nan",
    count: int | Literal["all"] = 1,
    generator: torch.Generator | None = None,
) -> int:
    """Write `count` bad values (distinct random columns, or the whole row) into each of
    `rows` of the 2-D view of `logits`; returns the number of values written."""
    flat = logits.view(-1, logits.shape[-1])
    vocab = flat.shape[-1]
    written = 0
    for row in rows:
        if count == "all":
            flat[row] = _VALUES[kind]
            written += vocab
            continue
        cols = torch.randperm(vocab, generator=generator)[: min(count, vocab)]
        flat[row, cols.to(flat.device)] = _VALUES[kind]
        written += int(cols.numel())
    return written


def reset_default() -> None:
    """Close and forget the process-wide instance so the next `default()` re-reads settings."""
    old = _reset_default()
    if old is not None:
        old.close()
