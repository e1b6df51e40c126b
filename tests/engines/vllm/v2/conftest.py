"""Model Runner V2 on the CPU: the environment vLLM's own CPU worker runs V2 in.

V2 (`vllm/v1/worker/gpu/`) defines its kernels with `triton.jit` when its modules are
imported. Under TRITON_INTERPRET=1 they run in Triton's interpreter on CPU tensors, and an
empty CUDA_VISIBLE_DEVICES keeps vLLM's Triton check (`vllm.triton_utils.HAS_TRITON`) true
with no driver (its lenient path for workers whose devices are not visible yet). Both must be
set before vLLM is imported, so they are set here, when pytest loads this file, before any
test module of this directory imports vLLM; a process that imported vLLM first is refused.
Then `vllm.v1.worker.cpu.shm` is imported, as vLLM's CPU worker does first thing: it stands
CUDA streams and events in with no-ops and points V2's buffers at CPU memory.

Run as its own process: `pytest tests/engines/vllm/v2` (the V1 half, `tests/engines/vllm`,
ignores this directory).
"""

from __future__ import annotations

import os
import sys

import pytest

_early = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
if _early:
    raise pytest.UsageError(
        "tests/engines/vllm/v2 must run in a process that has not imported vLLM yet "
        f"(found {_early[0]}): run `pytest tests/engines/vllm/v2` on its own"
    )
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import vllm.v1.worker.cpu.shm  # noqa: E402, F401  (patches torch for CPU, as vLLM's CPU worker)


@pytest.fixture(autouse=True)
def cpu_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every V2 test: the labelled stand-ins of runner.py for V2's Triton top-k/top-p and for
    load_model's device-memory probe."""
    from .runner import apply_cpu_stand_ins

    apply_cpu_stand_ins(monkeypatch)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    stray = [i.nodeid for i in items if not str(i.path).startswith(here + os.sep)]
    if stray:
        raise pytest.UsageError(
            f"tests/engines/vllm/v2 runs on its own (its environment changes vLLM's): {stray[0]}"
        )
