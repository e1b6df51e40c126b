"""Every real-server suite: a SIGTERM from `timeout` (run.sh's bound) is an interrupt, so pytest
still stops the servers it started; the summary lists each server's start-up time."""

from __future__ import annotations

import signal
from typing import Any

from tests.e2e.server import STARTED


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _interrupt)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not STARTED:
        return
    terminalreporter.section("real servers started (seconds to a healthy /health)")
    for command, seconds in STARTED:
        terminalreporter.write_line(f"{seconds:6.1f} s  {command} ...")
