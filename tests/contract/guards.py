"""The implementations of the logits contract, each driven the way a site drives it.

    reference            guardrails.kernels.reference (plain torch, any device and layout)
    cpu, cpu_chunk7,     the CPU kernel with its default chunks, and with chunks so short that
    cpu_chunk2           small tensors span many chunks and a tail
    triton_whole_rows,   the Triton kernel run by Triton's interpreter (TRITON_INTERPRET=1):
    triton_split_1,      one program per row, and rows cut into programs of one or two
    triton_split_2       16-column blocks
    site                 the public path: `Guardrails(...).site(name)(x)`

A driver is opened for one site mode (`Mode`) and then called on tensors one after another,
as a site is: its flags buffer, counts and kernel workspace persist between calls, so what a
call leaves behind must not leak into the next one. Each call returns the row flags and what
the call added to each count (`Outcome`), for the tests to compare with the oracle.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from guardrails.flags import LOGITS_SLOTS
from guardrails.kernels.base import HealSpec
from guardrails.logs import SilentLogger
from guardrails.testing import fresh_guardrails
from tests.contract.oracle import (
    LOGITS_COUNTS,
    MIN_TEMPERATURE,
    Expected,
    default_posinf_value,
    expected_logits,
)

SITE = "contract.logits"
CPU = ("reference", "cpu", "cpu_chunk7", "cpu_chunk2", "site")
TRITON = ("triton_whole_rows", "triton_split_1", "triton_split_2")
IMPLEMENTATIONS = CPU + TRITON
# (block, iters) of each interpreted Triton cut: whole rows, and rows split into programs.
TRITON_CUTS = {
    "triton_whole_rows": (4096, None),
    "triton_split_1": (16, 1),
    "triton_split_2": (16, 2),
}


@dataclass(frozen=True)
class Mode:
    """The settings of a site that the numeric contract depends on."""

    sanitize: bool = True
    count_neginf: bool = False
    nan_value: float = -math.inf
    posinf_value: float | None = None  # None: the default rule
    min_temperature: float = MIN_TEMPERATURE

    def expected(self, x: torch.Tensor) -> Expected:
        """The oracle's outcome of one call on `x` (call it before the guard runs)."""
        return expected_logits(
            x,
            sanitize=self.sanitize,
            count_neginf=self.count_neginf,
            nan_value=self.nan_value,
            posinf_value=self.posinf_value,
            min_temperature=self.min_temperature,
        )

    def spec(self, dtype: torch.dtype) -> HealSpec:
        """The kernel's `HealSpec` for this mode: the default +Inf value from the oracle's rule
        (the site path resolves its own, from the settings)."""
        posinf = self.posinf_value
        if posinf is None:
            posinf = default_posinf_value(dtype, self.min_temperature)
        return HealSpec(self.nan_value, posinf, self.sanitize, self.count_neginf)


@dataclass(frozen=True)
class Outcome:
    flags: torch.Tensor  # uint8 [rows], a copy on the CPU
    counts: dict[str, int]  # what this call added to each count


Driver = Callable[[torch.Tensor], Outcome]


class KernelDriver:
    """A logits kernel called as a site calls it: one flags buffer, one int64 counts buffer
    and one workspace, grown like a site's and reused across calls."""

    def __init__(self, kernel: Any, mode: Mode) -> None:
        self.kernel = kernel
        self.mode = mode
        self.capacity = 0
        self.flags = torch.empty(0, dtype=torch.uint8)
        self.counts = torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)
        self.workspace: Any = None

    def _reserve(self, rows: int, device: torch.device) -> None:
        if rows <= self.capacity and self.flags.device == device:
            return
        self.capacity = max(rows, 2 * self.capacity)
        # Stale bytes, as if an earlier call had flagged every row: each call must write
        # every flag of its rows.
        self.flags = torch.full((self.capacity,), 255, dtype=torch.uint8, device=device)
        self.counts = self.counts.to(device)
        self.workspace = self.kernel.workspace(self.capacity, device)
        if hasattr(self.workspace, "extent"):
            # The CPU kernel re-zeroes only the flags its bookkeeping says may be dirty.
            self.workspace.extent = self.capacity

    def __call__(self, x: torch.Tensor) -> Outcome:
        rows = math.prod(x.shape[:-1])
        if rows == 0:  # a site never calls its kernel without a row
            return Outcome(torch.empty(0, dtype=torch.uint8), dict.fromkeys(LOGITS_COUNTS, 0))
        self._reserve(rows, x.device)
        before = self.counts.clone()
        flags = self.flags[:rows]
        self.kernel(x, flags, self.counts, self.mode.spec(x.dtype), self.workspace)
        added = (self.counts - before).tolist()
        kinds = [str(kind) for kind in LOGITS_SLOTS]  # the buffer's layout
        return Outcome(flags.cpu().clone(), dict(zip(kinds, added, strict=True)))


class SiteDriver:
    """`site(x)` of a fresh `Guardrails` whose settings are the mode's."""

    def __init__(self, mode: Mode, dtypes: tuple[torch.dtype, ...] | None) -> None:
        site: dict[str, Any] = {"count_neginf": mode.count_neginf, "nan_value": mode.nan_value}
        if mode.posinf_value is not None:
            site["posinf_value"] = mode.posinf_value
        if dtypes is not None:
            site["dtypes"] = [str(d).removeprefix("torch.") for d in dtypes]
        self.guards = fresh_guardrails(
            sanitize=mode.sanitize,
            min_temperature=mode.min_temperature,
            sites={SITE: site},
            logger=SilentLogger(),
        )
        self.site = self.guards.site(SITE)

    def __call__(self, x: torch.Tensor) -> Outcome:
        before = self.guards.counts()
        flags = self.site(x).cpu().clone()  # a view of the site's buffer until its next call
        after = self.guards.counts()
        added = {k: after.get((SITE, k), 0) - before.get((SITE, k), 0) for k in LOGITS_COUNTS}
        calls = after[(SITE, "calls")] - before.get((SITE, "calls"), 0)
        assert calls == 1, f"one call counted {calls} calls"
        return Outcome(flags, added)


def load_kernel(name: str, triton_device_code: ModuleType | None = None) -> Any:
    """The kernel behind implementation `name` (not the site)."""
    if name == "reference":
        from guardrails.kernels.reference import REFERENCE_KERNEL

        return REFERENCE_KERNEL
    if name.startswith("cpu"):
        from guardrails.kernels._cpu import CPU_KERNEL, CpuLogitsKernel

        return (
            CpuLogitsKernel(chunk=int(name.removeprefix("cpu_chunk")))
            if "_" in name
            else CPU_KERNEL
        )
    from guardrails.kernels import triton_impl

    assert triton_device_code is not None, "the Triton kernels run interpreted: pass the module"
    block, iters = TRITON_CUTS[name]
    return triton_impl.build(triton_device_code, block=block, iters=iters)


@contextlib.contextmanager
def open_driver(
    name: str,
    mode: Mode,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    triton_device_code: ModuleType | None = None,
) -> Iterator[Driver]:
    """A driver of implementation `name` in `mode`; `dtypes`: what the site must accept."""
    if name == "site":
        driver = SiteDriver(mode, dtypes)
        try:
            yield driver
        finally:
            driver.guards.close()
        return
    yield KernelDriver(load_kernel(name, triton_device_code), mode)
