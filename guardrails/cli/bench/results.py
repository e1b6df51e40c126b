"""What `guardrails bench` measures with, and what it found: dataclasses until `to_json()`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from guardrails.cli.bench.machine import Machine

__all__ = ["BenchConfig", "BenchResult", "CaseResult", "HostOverhead"]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. At least `repeats` timed calls per method and case, more while the
    case has run under `min_seconds` (at most 50 x `repeats`); medians are reported."""

    batches: tuple[int, ...] = (1, 8, 64, 256)
    vocab: int = 151936
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    device: str = "cpu"
    repeats: int = 60
    min_seconds: float = 0.3  # per case: more repeats for fast cases, steadier medians
    dirty_fraction: float = 0.01
    bad_per_row: int = 5  # NaN and +Inf entries written into each dirty row
    tiny_shape: tuple[int, int] = (4, 64)
    tiny_repeats: int = 2000

    @classmethod
    def smoke(cls, device: str = "cpu") -> BenchConfig:
        """A few seconds: tiny tensors, few repeats (structure, not numbers)."""
        return cls(
            batches=(1, 3),
            vocab=1000,
            device=device,
            repeats=5,
            min_seconds=0.0,
            tiny_repeats=50,
        )


@dataclass(frozen=True)
class CaseResult:
    """One (batch, dtype, state): median microseconds per method, and the guard's ratios.
    `one_read_us` (and the ratio `guard_vs_one_read`) only on CUDA."""

    batch: int
    dtype: str
    state: str
    dirty_rows: int
    median_us: dict[str, float]
    samples: int
    ratios: dict[str, float] = field(default_factory=dict)
    guard_calls: int = 0
    guard_healed: int = 0
    one_read_us: float | None = None


@dataclass(frozen=True)
class HostOverhead:
    """Host time of one guarded call on a tiny clean tensor; on the CPU also the clean check
    alone and the difference (what the guard's own Python costs)."""

    shape: tuple[int, ...]
    median_us: float
    check_us: float | None = None
    own_us: float | None = None


@dataclass(frozen=True)
class BenchResult:
    machine: Machine
    config: BenchConfig
    kernel: str  # the choice the site made
    timing: str
    host_overhead: HostOverhead
    cases: tuple[CaseResult, ...]
    d2d_copy_bandwidth_gbs: float | None = None  # CUDA only

    @property
    def on_cuda(self) -> bool:
        return self.machine.device.startswith("cuda")

    def to_json(self) -> dict[str, Any]:
        """The JSON document (keys absent where a value was not measured)."""
        document: dict[str, Any] = {
            "machine": self.machine.to_json(),
            "config": asdict(self.config),
            "kernel": self.kernel,
            "timing": self.timing,
            "host_overhead_us": _present(asdict(self.host_overhead)),
            "cases": [_present(asdict(case)) for case in self.cases],
        }
        document["host_overhead_us"]["shape"] = list(self.host_overhead.shape)
        if self.d2d_copy_bandwidth_gbs is not None:
            document["d2d_copy_bandwidth_gbs"] = self.d2d_copy_bandwidth_gbs
        return document

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> BenchResult:
        """The result a `to_json()` document (a written file, read back) holds."""
        config = dict(document["config"])
        for key in ("batches", "dtypes", "tiny_shape"):
            config[key] = tuple(config[key])
        host = dict(document["host_overhead_us"])
        host["shape"] = tuple(host["shape"])
        return cls(
            machine=Machine(**document["machine"]),
            config=BenchConfig(**config),
            kernel=document["kernel"],
            timing=document["timing"],
            host_overhead=HostOverhead(**host),
            cases=tuple(CaseResult(**case) for case in document["cases"]),
            d2d_copy_bandwidth_gbs=document.get("d2d_copy_bandwidth_gbs"),
        )


def _present(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}
