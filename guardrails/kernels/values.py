"""Replacement values: what a healed entry becomes, and the rule that keeps it safe.

The rule, in one place: a replacement must be finite as stored in the logits' dtype and stay
finite after the engine divides by any temperature it allows (`>= min_temperature`). The
default +Inf value and the check of configured values (`GuardSettings`) both follow it.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "finite_after_temperature",
    "posinf_replacement",
    "replacement_problem",
    "stored_value",
]


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


def finite_after_temperature(value: float, dtype: torch.dtype, min_temperature: float) -> bool:
    """Whether `value`, stored in `dtype`, stays finite there after `/ min_temperature` (and
    so after division by any larger temperature)."""
    as_dtype = torch.tensor(value, dtype=dtype)
    scaled = as_dtype / torch.tensor(min_temperature, dtype=dtype)
    return bool(torch.isfinite(as_dtype)) and bool(torch.isfinite(scaled))


@functools.cache
def stored_value(value: float, dtype: torch.dtype) -> float:
    """`value` as the reference's `masked_fill_` stores it in `dtype` (rounded once, the same
    way), so a kernel that converts it again never rounds differently."""
    cell = torch.zeros(1, dtype=dtype)
    cell.masked_fill_(torch.ones(1, dtype=torch.bool), value)
    return float(cell.item())


def replacement_problem(
    key: str, value: float, dtypes: tuple[str, ...], min_temperature: float
) -> str:
    """Why `value` is not a safe replacement for every dtype in `dtypes`, or ''."""
    if math.isnan(value) or value == math.inf:
        return f"{key} must not be NaN or +inf"
    if key == "posinf_value" and not math.isfinite(value):
        return "posinf_value must be finite"
    if not math.isfinite(value):
        return ""  # -inf is the default NaN replacement: a mask, safe at any temperature
    for name in dtypes:
        dtype = getattr(torch, name)
        if not finite_after_temperature(value, dtype, min_temperature):
            limit = torch.finfo(dtype).max * min(1.0, min_temperature)
            return (
                f"{key}={value:g} overflows {name} after division by min_temperature="
                f"{min_temperature:g} (largest safe magnitude about {limit:.4g})"
            )
    return ""
