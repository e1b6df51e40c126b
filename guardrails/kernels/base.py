"""What every logits kernel shares: the per-(site, dtype) `HealSpec`, the `LogitsKernel`
signature, and the one way to view logits as rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["HealSpec", "LogitsKernel", "as_rows"]


@dataclass(frozen=True)
class HealSpec:
    """What a site does with the bad values of one dtype; resolved once per (site, dtype)."""

    nan_value: float
    posinf_value: float
    sanitize: bool
    count_neginf: bool


class LogitsKernel(Protocol):
    """One detect+count+heal implementation.

    A kernel may also have `check_rows(x, rows, vocab, dtype, flags, ws) -> bool`: a
    host-side clean check the site runs first on a 2-d `x` whose shape and dtype it has read.
    True: `x` is proved clean and `flags` are settled, the call is done; False: the call goes
    on to `__call__` (which may reuse what the check learnt).
    """

    name: str

    def workspace(self, rows: int, device: torch.device) -> Any:
        """Persistent per-(site, device) state for up to `rows` rows, made outside the hot
        path: device scratch for the Triton kernel, host bookkeeping for the CPU one."""
        ...

    def __call__(
        self, x: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor, spec: HealSpec, ws: Any
    ) -> None: ...


def as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x` as a 2-D `[rows, V]` view, or None where its leading dims cannot be flattened
    without a copy (a copy would lose the in-place heal): the reference handles those."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None
