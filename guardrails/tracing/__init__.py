"""Tracing: detect-only probes that name the module where a NaN/Inf was born.

See `guardrails.tracing.tracer` (the probes and their cost) and `guardrails.tracing.origin`
(the rule that names the origin).
"""

from guardrails.tracing.modes import TraceMode, parse_mode
from guardrails.tracing.origin import Origin, find_origin
from guardrails.tracing.tracer import Trace, match_modules

__all__ = ["Origin", "Trace", "TraceMode", "find_origin", "match_modules", "parse_mode"]
