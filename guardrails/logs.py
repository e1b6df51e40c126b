"""Where guardrails' log events go: the host's logging, never a configuration of its own.

`HostLogger` delivers each event through structlog when the host configured structlog (its
processors and renderer are the host's choice), and otherwise through the standard library
logger `guardrails`, which is what vLLM, SGLang and most servers configure: the event name and
its fields become the message (`guardrails.nonfinite_logits site=sampler.logits nan=3 ...`)
and attributes of the record (`record.site`, `record.nan`, via `extra`). Nothing is printed
by guardrails itself: with no handler configured anywhere, the standard library's last resort
writes warnings and errors to standard error.

`configure_json_logs()` is the one set-up guardrails offers, and only on request
(`GUARDRAILS_LOG_FORMAT=json`, or a direct call): it sets structlog up to write one JSON
object per line, and does nothing when the host has already configured structlog.

    import guardrails as gr
    gr.configure_json_logs()    # True if it configured structlog, False if the host had
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final, TextIO

import structlog

from guardrails.names import LOGGER_NAME

__all__ = ["HostLogger", "SilentLogger", "configure_json_logs", "render_message"]


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


_LEVELS: Final = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# Attributes a LogRecord already has: `extra` may not overwrite them (logging raises).
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
}
_BARE: Final = re.compile(r"[\w.:/@+\-]+")


class HostLogger:
    """guardrails' logger: structlog when the host configured it, else stdlib `logging`.

    Chosen per event, not at construction: a host may configure its logging after building
    guardrails (under `guardrails run`, guardrails starts before the engine's own code). Events
    are rare (throttled), so the check costs nothing that matters.
    """

    def __init__(self, name: str = LOGGER_NAME) -> None:
        self.name = name

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)

    def _log(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger(self.name), method)(event, **fields)
            return
        logger = logging.getLogger(self.name)
        level = _LEVELS[method]
        if logger.isEnabledFor(level):
            extra = {k: v for k, v in fields.items() if k not in _RECORD_ATTRS}
            extra["event"] = event
            logger.log(level, "%s", render_message(event, fields), extra=extra)


def render_message(event: str, fields: Mapping[str, Any]) -> str:
    """`event key=value ...`: strings bare where unambiguous, anything else as JSON."""
    return " ".join([event, *(f"{key}={_text(value)}" for key, value in fields.items())])


def _text(value: object) -> str:
    if isinstance(value, str) and _BARE.fullmatch(value):
        return value
    try:
        return json.dumps(value, separators=(",", ":"), default=str)
    except ValueError:  # a circular structure: never from guardrails' own fields
        return repr(value)


class SilentLogger:
    """A logger for `Guardrails(logger=...)` that drops every event; counting is unaffected."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _drop


def _drop(*args: Any, **kwargs: Any) -> None:
    return None
