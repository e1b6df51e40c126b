"""The machine a benchmark ran on, as recorded beside its numbers."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Machine", "probe"]


@dataclass(frozen=True)
class Machine:
    platform: str
    python: str
    torch: str
    cpu: str
    cpu_count: int | None
    torch_threads: int
    device: str
    triton: str | None
    gpu: str | None = None  # the three below on CUDA only
    gpu_sms: int | None = None
    gpu_memory_gib: float | None = None

    @property
    def name(self) -> str:
        """The GPU's name on CUDA, else the CPU's."""
        return self.gpu or self.cpu

    def to_json(self) -> dict[str, Any]:
        info = asdict(self)
        if self.gpu is None:
            for key in ("gpu", "gpu_sms", "gpu_memory_gib"):
                del info[key]
        return info


def probe(device: torch.device) -> Machine:
    """What this process runs on, for `device`."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    gpu: dict[str, Any] = {}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "gpu": props.name,
            "gpu_sms": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        }
    return Machine(
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        cpu=_cpu_name(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        device=str(device),
        triton=triton_version,
        **gpu,
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
