"""Detect + count + heal implementations, one per kind of device.

Every logits kernel has the signature of `LogitsKernel`: it reads `x` ([..., V], V > 0, at
least one row), writes one uint8 flag per row into `flags`, adds its counts into the int64
buffer `counts` (layout `guardrails.flags.LOGITS_SLOTS`) and, if `spec.sanitize`, heals `x` in
place. No kernel may allocate memory proportional to `x` on its clean path, and the CUDA ones
may not synchronise with the host.

- `reference`: branch-free torch; the oracle, and the CUDA path when Triton is missing.
- `cpu`: one reduction for a clean batch, exact work only on the chunks it flags.
- `triton_impl`: one fused launch on CUDA (optional extra `guardrails-logits[triton]`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "HealSpec",
    "LogitsKernel",
    "posinf_replacement",
    "select_logits_kernel",
    "stored_value",
]


@dataclass(frozen=True)
class HealSpec:
    """What a site does with the bad values of one dtype; resolved once per (site, dtype)."""

    nan_value: float
    posinf_value: float
    sanitize: bool
    count_neginf: bool


class LogitsKernel(Protocol):
    """One detect+count+heal implementation."""

    name: str

    def workspace(self, rows: int, device: torch.device) -> Any:
        """Persistent per-(site, device) state for up to `rows` rows, made outside the hot
        path: device scratch for the Triton kernel, host bookkeeping for the CPU one."""
        ...

    def __call__(
        self, x: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor, spec: HealSpec, ws: Any
    ) -> None: ...


def posinf_replacement(dtype: torch.dtype, min_temperature: float) -> float:
    """The default value for +Inf: `min(1e30, 0.5 * finfo.max * min(1, min_temperature))`.

    Half the dtype's range, scaled by the smallest temperature the engine divides by, so the
    value stays finite both as stored and after `logits / T` for every allowed T; capped at
    1e30 so float32 logits keep the familiar magnitude (SGLang's constant).
    """
    value = min(1e30, 0.5 * torch.finfo(dtype).max * min(1.0, min_temperature))
    # The largest value the dtype represents exactly that is <= the formula's, so storing it
    # cannot round up past the bound.
    stored = torch.tensor(value, dtype=torch.float64).to(dtype)
    while not math.isfinite(float(stored)) or float(stored) > value:
        stored = torch.nextafter(stored, torch.tensor(0.0, dtype=dtype))
    return float(stored)


@functools.cache
def stored_value(value: float, dtype: torch.dtype) -> float:
    """`value` as the reference's `masked_fill_` stores it in `dtype` (rounded once, the same
    way), so a kernel that converts it again never rounds differently."""
    cell = torch.zeros(1, dtype=dtype)
    cell.masked_fill_(torch.ones(1, dtype=torch.bool), value)
    return float(cell.item())


def select_logits_kernel(device: torch.device) -> LogitsKernel:
    """The fastest available implementation for tensors on `device`."""
    if device.type == "cpu":
        from guardrails.kernels.cpu import CPU_KERNEL

        return CPU_KERNEL
    if device.type == "cuda":
        from guardrails.kernels import triton_impl

        kernel = triton_impl.kernel()
        if kernel is not None:
            return kernel
    from guardrails.kernels.reference import REFERENCE_KERNEL

    return REFERENCE_KERNEL
