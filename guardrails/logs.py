"""Opt-in JSON log lines for hosts that have not configured structlog, and a logger that
drops every event (benchmarks, fuzz tests).

guardrails logs through `structlog.get_logger("guardrails")` and never configures logging on
its own. `configure_json_logs()` is the one exception, and only on request
(`GUARDRAILS_LOG_FORMAT=json`, or a direct call): it sets structlog up to write one JSON
object per line, and does nothing when the host has already configured structlog.

    import guardrails as gr
    gr.configure_json_logs()    # True if it configured structlog, False if the host had
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import structlog

__all__ = ["SilentLogger", "configure_json_logs"]


def configure_json_logs(file: TextIO | None = None, *, force: bool = False) -> bool:
    """Send structlog events as JSON lines to `file` (default: standard error).

    Returns False, changing nothing, when structlog is already configured (the host's choice
    wins) unless `force`. Standard error, because standard output often carries a program's
    own output (the `guardrails` CLI prints results there).
    """
    if structlog.is_configured() and not force:
        return False
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr if file is None else file),
        cache_logger_on_first_use=False,
    )
    return True


class SilentLogger:
    """A logger for `Guardrails(logger=...)` that drops every event; counting is unaffected."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _drop


def _drop(*args: Any, **kwargs: Any) -> None:
    return None
