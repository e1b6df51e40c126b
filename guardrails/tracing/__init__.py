"""Tracing: detect-only probes that name the module where a NaN/Inf was born.

See `guardrails.tracing.tracer` (the probes and their cost) and `guardrails.tracing.origin`
(the rule that names the origin). `Trace` and `match_modules` are imported on first use:
the settings import this package's mode parser, and settings never pay torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guardrails.tracing.modes import MODE_SYNTAX, TraceMode, parse_mode
from guardrails.tracing.origin import Origin, find_origin

if TYPE_CHECKING:
    from guardrails.tracing.tracer import Trace, match_modules

__all__ = [
    "MODE_SYNTAX",
    "Origin",
    "Trace",
    "TraceMode",
    "find_origin",
    "match_modules",
    "parse_mode",
]


def __getattr__(name: str) -> Any:
    if name in ("Trace", "match_modules"):
        from guardrails.tracing import tracer

        return getattr(tracer, name)
    raise AttributeError(f"module 'guardrails.tracing' has no attribute {name!r}")
