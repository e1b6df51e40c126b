"""SGLang's own sampler, scheduler result processing and EAGLE verification on CPU.

Runs inside `.engines/sglang-<version>` (`make engines`). The torchvision stub goes on
sys.path here, before anything imports SGLang (see tests/engines/stubs/torchvision). SGLang
reads its process-wide configuration (server args, the tensor-parallel group) when a Sampler
is built; `engine` publishes a single-rank CPU configuration the way each version's own
tests do, once per session, so that importing and configuring SGLang (~30 s) happens once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

STUBS = Path(__file__).resolve().parents[1] / "stubs"
if str(STUBS) not in sys.path:
    sys.path.insert(0, str(STUBS))

from tests.engines.sglang.engine import Engine, load_engine  # noqa: E402  (after the stub path)


@pytest.fixture(scope="session")
def engine() -> Engine:
    return load_engine()
