"""The reference logits kernel: plain torch, branch-free, any device, any strides.

Each step is a whole-tensor op with no host round trip, so on CUDA it never synchronises and
can be captured in a graph; it simply makes several passes. It serves where no fast kernel
does (CUDA without Triton, layouts the fast kernels cannot view, an empty vocabulary) and
the fast kernels' fallbacks; the tests hold all of them to an oracle of their own.
"""

from __future__ import annotations

from typing import Any

import torch

from guardrails.flags import RowFlag
from guardrails.kernels.base import HealSpec

__all__ = ["REFERENCE_KERNEL", "guard_logits_reference_"]

_U8 = torch.uint8


def guard_logits_reference_(
    x: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor, spec: HealSpec
) -> None:
    """Detect, flag, count and (if `spec.sanitize`) heal `x` ([..., V]) in place."""
    nan = torch.isnan(x)
    pinf = torch.isposinf(x)
    ninf = torch.isneginf(x)
    no_valid = (nan | ninf).all(-1)
    any_nan = nan.any(-1)
    any_pinf = pinf.any(-1)
    row = any_nan.to(_U8) * int(RowFlag.NAN) + any_pinf.to(_U8) * int(RowFlag.POSINF)
    nonfinite = any_nan | any_pinf
    if spec.count_neginf:
        any_ninf = ninf.any(-1)
        row += any_ninf.to(_U8) * int(RowFlag.NEGINF)
        nonfinite |= any_ninf
        n_ninf = ninf.sum()
    else:
        n_ninf = torch.zeros((), dtype=torch.int64, device=x.device)
    row += no_valid.to(_U8) * int(RowFlag.NO_VALID_TOKEN)
    flags.copy_(row.reshape(-1))
    counts.add_(torch.stack([nan.sum(), pinf.sum(), n_ninf, nonfinite.sum(), no_valid.sum()]))
    if spec.sanitize:
        x.masked_fill_(nan, spec.nan_value)
        x.masked_fill_(pinf, spec.posinf_value)
        # A row with nothing left to sample is written uniform (all 0): samplable, and
        # flagged NO_VALID_TOKEN so the engine can abort the request instead.
        x.masked_fill_(no_valid.unsqueeze(-1), 0.0)


class _ReferenceKernel:
    name = "reference"

    def workspace(self, rows: int, device: torch.device) -> Any:
        return None

    def __call__(
        self, x: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor, spec: HealSpec, ws: Any
    ) -> None:
        guard_logits_reference_(x, flags, counts, spec)


REFERENCE_KERNEL = _ReferenceKernel()
