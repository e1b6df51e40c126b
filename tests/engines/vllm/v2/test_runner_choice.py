"""Which model runner a default vLLM 0.33.0 deployment on a GPU gets, by vLLM's own choice:
`VllmConfig.use_v2_model_runner` evaluated for vLLM's `CudaPlatform` with Triton importable,
and `Worker._make_model_runner` building the class that choice names.

When a new vLLM pin changes the default, this fails, and the profile's runner halves need a
look. No GPU is here: only what platform detection needs is constructed. vLLM's CUDA
platform module imports vLLM's CUDA extension for its op registrations (it needs libcuda);
an empty module stands in for that extension while the platform class is imported, and an
instance of the class vLLM selects without NVML (`NonNvmlCudaPlatform`) replaces
`current_platform` where `use_v2_model_runner` reads it. The Triton check is vLLM's own
(`vllm.triton_utils.HAS_TRITON`, true in this process: see conftest.py).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ..faults import vllm_config
from .runner import DEVICE, init_distributed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's CudaPlatform as `current_platform` of vllm.config.vllm; returns that module."""
    import vllm.config.vllm as config_module

    # STAND-IN (test only): the CUDA extension vllm/platforms/cuda.py imports first thing.
    monkeypatch.setitem(
        sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch")
    )
    from vllm.platforms.cuda import CudaPlatform

    platform = CudaPlatform()
    assert platform.is_cuda()
    assert not platform.is_unspecified()
    monkeypatch.setattr(config_module, "current_platform", platform)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return config_module


def test_a_default_gpu_deployment_gets_model_runner_v2(on_cuda, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_worker import Worker

    assert HAS_TRITON
    assert on_cuda.HAS_TRITON
    config = vllm_config(tmp_path)
    assert config.use_v2_model_runner is True
    init_distributed(config, tmp_path)
    # Worker._make_model_runner with what Worker.__init__ sets from the config.
    worker = types.SimpleNamespace(
        use_v2_model_runner=config.use_v2_model_runner, vllm_config=config, device=DEVICE
    )
    runner = Worker._make_model_runner(worker)  # type: ignore[arg-type]
    assert type(runner) is V2


def test_vllm_use_v2_model_runner_0_gets_the_v1_runner(  # type: ignore[no-untyped-def]
    on_cuda, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert vllm_config(tmp_path).use_v2_model_runner is False


def test_a_gpu_without_triton_gets_the_v1_runner(on_cuda, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(on_cuda, "HAS_TRITON", False)
    assert vllm_config(tmp_path).use_v2_model_runner is False
