"""CUDA fast path: one fused Triton launch per guard call (optional extra `[triton]`).

`kernel()` returns the process-wide `TritonLogitsKernel`, or None where Triton cannot be
imported (CUDA then uses the branch-free torch reference). The device code and its
memory-ordering argument live in `guardrails.kernels._triton_kernel`.

Per call the host only picks a cached launch plan by `(rows, vocab, dtype)` and launches:
no allocation, no host sync, nothing that depends on the data, so a call can be captured in
a CUDA graph. The per-row scratch the split rows need is made by `workspace()`, which the
site calls when it sizes its buffers.

Triton compiles one binary per variant (dtype, block, warps, split or whole rows, site mode,
and the 16-byte alignment / value-1 specialisations of the pointers and integers it is
given). Compiling and loading one inside a CUDA-graph capture is not safe, so a call being
captured whose variant has not been launched on that device yet is guarded by the torch
reference instead (branch-free, capture-safe, exact; slower): capture after one eager call
at each batch size to keep the kernel in the graph.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from guardrails.kernels.base import HealSpec, as_rows
from guardrails.kernels.reference import guard_logits_reference_
from guardrails.kernels.values import stored_value

__all__ = ["LaunchPlan", "TritonLogitsKernel", "TritonWorkspace", "build", "kernel"]

# Programs per SM the automatic plan aims for: enough resident loads to cover DRAM latency
# on a large batch, while a small batch (B=1: 38 blocks of a 151936 vocab) gets one program
# per block instead of one per row. A 4096-column block on 8 warps is 16 values per thread
# (four 16-byte loads for float32, two for 16-bit types); ptxas reports ~46 registers for
# sm_90, so about five such programs fit on an SM at once.
_PROGRAMS_PER_SM = 4
_INT32_MAX = 2**31 - 1
_KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class LaunchPlan:
    """How one `(rows, vocab, dtype)` shape is cut: `splits` programs of `chunk` columns."""

    block: int
    chunk: int
    splits: int
    num_warps: int


class TritonWorkspace:
    """Per-(site, device) state: the rows' packed tickets and the cached launch plans."""

    __slots__ = ("plans", "rowstate", "sm_count")

    def __init__(self, rows: int, device: torch.device, sm_count: int) -> None:
        with torch.inference_mode(False):
            # Every finishing program writes its row's word back to 0: zero between calls.
            self.rowstate = torch.zeros(max(rows, 1), dtype=torch.int64, device=device)
        self.sm_count = sm_count
        self.plans: dict[tuple[int, int, torch.dtype], LaunchPlan] = {}


class TritonLogitsKernel:
    """The `LogitsKernel` backed by `_triton_kernel.guard_logits_kernel`.

    `block` (a power of two) is the number of columns a program handles per loop step;
    `iters` fixes the loop steps per program (None: derived from the SM count so the grid
    holds about `programs_per_sm` programs per SM). Tests set small values to force rows
    split across many programs on tiny tensors.
    """

    name = "triton"

    def __init__(
        self,
        jit_kernel: Any,
        *,
        block: int = 4096,
        iters: int | None = None,
        programs_per_sm: int = _PROGRAMS_PER_SM,
        max_splits: int,
        max_iters: int,
        capturing: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        if block <= 0 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        if iters is not None and not 1 <= iters <= max_iters:
            raise ValueError(f"iters must be in [1, {max_iters}], got {iters}")
        self._jit = jit_kernel
        self._block = block
        self._iters = iters
        self._programs_per_sm = programs_per_sm
        self._max_splits = max_splits
        self._max_iters = max_iters
        self._values: dict[tuple[HealSpec, torch.dtype], tuple[float, float]] = {}
        # Whether a call is being captured into a CUDA graph (tests replace it), and the
        # variants launched so far, by device (see the module docstring).
        self._capturing = _capturing if capturing is None else capturing
        self._launched: set[tuple[Any, ...]] = set()

    def workspace(self, rows: int, device: torch.device) -> TritonWorkspace:
        if device.type == "cuda":
            sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            sm_count = 1  # the interpreter (tests): the plan is only about splitting rows
        return TritonWorkspace(rows, device, sm_count)

    def plan(self, rows: int, vocab: int, dtype: torch.dtype, ws: TritonWorkspace) -> LaunchPlan:
        """The cached cut of `[rows, vocab]` for this workspace's device."""
        key = (rows, vocab, dtype)
        plan = ws.plans.get(key)
        if plan is None:
            plan = ws.plans[key] = self._plan(rows, vocab, ws.sm_count)
        return plan

    def _plan(self, rows: int, vocab: int, sm_count: int) -> LaunchPlan:
        # Small vocabularies do not need a whole 4096-lane block.
        block = min(self._block, max(16, 1 << (vocab - 1).bit_length()))
        blocks = -(-vocab // block)
        if self._iters is not None:
            iters = self._iters
        else:
            target = max(1, sm_count * self._programs_per_sm)
            iters = -(-rows * blocks // target)
        iters = max(1, min(iters, blocks, self._max_iters))
        splits = -(-blocks // iters)
        if splits > self._max_splits:
            splits = self._max_splits
        # Even out the chunks: the same number of programs, none with a tiny tail.
        iters = -(-blocks // splits)
        if iters > self._max_iters:
            raise ValueError(
                f"vocab {vocab} is too large for the Triton kernel's packed counters "
                f"(at most {self._max_splits * self._max_iters * block} columns)"
            )
        chunk = iters * block
        return LaunchPlan(
            block=block,
            chunk=chunk,
            splits=-(-vocab // chunk),
            num_warps=max(1, min(8, block // 512)),
        )

    def _replacements(self, spec: HealSpec, dtype: torch.dtype) -> tuple[float, float]:
        key = (spec, dtype)
        values = self._values.get(key)
        if values is None:
            # Exactly the values the reference stores, so the fp32 kernel argument converts
            # to the tensor's dtype without rounding.
            values = (stored_value(spec.nan_value, dtype), stored_value(spec.posinf_value, dtype))
            self._values[key] = values
        return values

    def __call__(
        self, x: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor, spec: HealSpec, ws: Any
    ) -> None:
        view = as_rows(x)
        if view is None or view.shape[1] == 0:
            guard_logits_reference_(x, flags, counts, spec)
            return
        x = view
        rows, vocab = x.shape
        stride_row, stride_col = x.stride()
        if x.dtype not in _KERNEL_DTYPES or (vocab - 1) * stride_col > _INT32_MAX:
            # The kernel classifies in float32 (float64 logits could overflow it) and uses
            # 32-bit column offsets; both cases are all but unheard of on a sampling path.
            guard_logits_reference_(x, flags, counts, spec)
            return
        plan = self.plan(rows, vocab, x.dtype, ws)
        if plan.splits > 1 and rows > ws.rowstate.numel():
            raise ValueError(
                f"the Triton workspace holds {ws.rowstate.numel()} rows, got {rows}; "
                "size it with workspace(rows, device)"
            )
        variant = (
            x.device,
            x.dtype,
            plan.block,
            plan.num_warps,
            plan.splits > 1,
            spec.sanitize,
            spec.count_neginf,
            x.data_ptr() % 16 == 0,
            _specialised(vocab),
            _specialised(stride_row),
            _specialised(stride_col),
            _specialised(plan.chunk),
        )
        if variant not in self._launched and self._capturing(x):
            # Not compiled and loaded inside a capture: the capture-safe reference.
            guard_logits_reference_(x, flags, counts, spec)
            return
        nan_value, posinf_value = self._replacements(spec, x.dtype)
        launch = self._jit[(rows, plan.splits)]
        args = (x, flags, counts, ws.rowstate, vocab, stride_row, stride_col, plan.chunk)
        options = {
            "BLOCK": plan.block,
            "SANITIZE": spec.sanitize,
            "COUNT_NEGINF": spec.count_neginf,
            "MULTI": plan.splits > 1,
            "num_warps": plan.num_warps,
        }
        # (CPU tensors: the tests' TRITON_INTERPRET=1 runs.)
        if not x.is_cuda or x.device.index == torch.cuda.current_device():
            launch(*args, nan_value, posinf_value, **options)
        else:
            # Triton launches on the current device's stream: the tensor's device must be it.
            with torch.cuda.device(x.device):
                launch(*args, nan_value, posinf_value, **options)
        self._launched.add(variant)  # compiled and loaded now


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _specialised(value: int) -> int:
    """How Triton specialises an integer argument: equal to 1, a multiple of 16, 64-bit."""
    return (value == 1) | (value % 16 == 0) << 1 | (value > _INT32_MAX) << 2


def build(device_code: ModuleType | None = None, **options: Any) -> TritonLogitsKernel:
    """A kernel over `device_code` (default: `_triton_kernel`, imported now).

    Tests pass a copy of that module loaded under `TRITON_INTERPRET=1`, and `block`/`iters`.
    """
    module = device_code or importlib.import_module("guardrails.kernels._triton_kernel")
    return TritonLogitsKernel(
        module.guard_logits_kernel,
        max_splits=module.MAX_SPLITS,
        max_iters=module.MAX_ITERS,
        **options,
    )


@functools.cache
def kernel() -> TritonLogitsKernel | None:
    """The Triton kernel, or None where Triton is not installed."""
    try:
        return build()
    except ImportError:
        return None
