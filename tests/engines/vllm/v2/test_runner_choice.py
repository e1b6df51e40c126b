"""Which model runner a default vLLM deployment gets, by vLLM's own choice. Before 0.34:
`VllmConfig.use_v2_model_runner` evaluated for vLLM's `CudaPlatform` with Triton importable,
and `Worker._make_model_runner` building the class that choice names. From 0.34.0 (no V1
runner): `Worker._make_model_runner` builds Model Runner V2 whatever VLLM_USE_V2_MODEL_RUNNER
says, and vLLM's CPU platform picks the standalone CPU runner (whose sampler and runner the
profile also guards) exactly where Triton is missing on a non-x86 CPU.

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

from guardrails.settings.targets import requirement_holds

from ..faults import vllm_config
from .runner import DEVICE, init_distributed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

V034 = bool(requirement_holds("vllm>=0.34"))
before_034 = pytest.mark.skipif(V034, reason="vLLM 0.34.0 removed the V1 runner and this choice")
from_034 = pytest.mark.skipif(
    not V034, reason="the choice vLLM 0.34.0 makes: V2 only, or its standalone CPU runner"
)


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


@before_034
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


@before_034
def test_vllm_use_v2_model_runner_0_gets_the_v1_runner(  # type: ignore[no-untyped-def]
    on_cuda, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert vllm_config(tmp_path).use_v2_model_runner is False


@before_034
def test_a_gpu_without_triton_gets_the_v1_runner(on_cuda, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(on_cuda, "HAS_TRITON", False)
    assert vllm_config(tmp_path).use_v2_model_runner is False


@from_034
@pytest.mark.parametrize("env", [None, "0"], ids=["default", "VLLM_USE_V2_MODEL_RUNNER=0"])
def test_every_gpu_deployment_gets_model_runner_v2(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch, env
) -> None:
    """No platform check is left in the choice (and 0.34's config asserts a CUDA torch
    under CudaPlatform): the worker's own method, on the platform this process has."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_worker import Worker

    if env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    config = vllm_config(tmp_path)
    init_distributed(config, tmp_path)
    worker = types.SimpleNamespace(vllm_config=config, device=DEVICE)
    runner = Worker._make_model_runner(worker)  # type: ignore[arg-type]
    assert type(runner) is V2


@from_034
@pytest.mark.parametrize(
    ("triton", "arch", "standalone"),
    [(True, "X86", False), (False, "X86", False), (True, "ARM", False), (False, "ARM", True)],
)
def test_the_cpu_platform_picks_the_standalone_runner_only_without_triton_off_x86(  # type: ignore[no-untyped-def]
    monkeypatch, triton, arch, standalone
) -> None:
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", triton)
    monkeypatch.setattr(
        CpuPlatform, "get_cpu_architecture", classmethod(lambda cls: getattr(CpuArchEnum, arch))
    )
    assert CpuPlatform.uses_standalone_cpu_model_runner() is standalone
