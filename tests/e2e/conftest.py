"""Every real-server suite: a SIGTERM from `timeout` (run.sh's bound) is an interrupt, so pytest
still stops the servers it started."""

from __future__ import annotations

import signal
from typing import Any


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _interrupt)
