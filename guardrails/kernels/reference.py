"""The reference implementation: plain torch, branch-free, any device, any strides.

Each step is a whole-tensor op with no host round trip, so on CUDA it never synchronises and
can be captured in a graph; it simply makes several passes. It defines the numeric contract
that the fast kernels are tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from guardrails.flags import RowFlag
from guardrails.kernels import HealSpec

__all__ = ["REFERENCE_KERNEL", "guard_logits_reference_", "guard_token_ids_"]

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


def guard_token_ids_(
    ids: torch.Tensor,
    flags: torch.Tensor,
    counts: torch.Tensor,
    vocab_size: int,
    replacement_id: int,
    sanitize: bool,
) -> None:
    """Flag, count and (if `sanitize`) replace ids outside [0, vocab_size), in place.

    Rows: one per id for 0-d and 1-d ids, one per `[..., k]` slice otherwise.
    Token-id tensors are a few bytes per row, so one branch-free pass is always cheap.
    """
    # Compared against the largest valid id, clamped to what the dtype holds: torch casts a
    # Python int to the tensor's dtype, so `ids >= 128` on int8 ids wrapped to `ids >= -128`
    # and flagged (and replaced) every valid id whenever vocab_size exceeded the dtype.
    high = min(vocab_size - 1, torch.iinfo(ids.dtype).max)
    oob = (ids < 0) | (ids > high)
    row = oob.any(-1) if ids.dim() >= 2 else oob
    flags.copy_(row.reshape(-1).to(_U8) * int(RowFlag.OOB_TOKEN))
    counts.add_(torch.stack([oob.sum(), row.sum()]))
    if sanitize:
        ids.masked_fill_(oob, replacement_id)
