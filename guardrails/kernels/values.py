"""Replacement values: what a healed entry becomes, and the rule that keeps it safe.

The rule, in one place: a replacement must be finite as stored in the logits' dtype and stay
finite after the engine divides by any temperature it allows (`>= min_temperature`), in the
dtype the engine divides in: float32 for float16/bfloat16/float32 logits (SGLang's logits
processor and vLLM's sampler both upcast to float32 before the temperature step), float64
for float64. A healed +Inf also keeps its rank: it becomes the largest value the logits'
dtype holds (1e30 at most), so greedy sampling still picks it and it outweighs every
ordinary logit. The default +Inf value and the check of configured values (`GuardSettings`)
both follow this rule.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "finite_after_temperature",
    "posinf_replacement",
    "replacement_problem",
    "sampling_dtype",
    "stored_value",
]


def sampling_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype engines divide `dtype` logits by the temperature in (at least float32)."""
    return torch.promote_types(dtype, torch.float32)


def posinf_replacement(dtype: torch.dtype, min_temperature: float) -> float:
    """The default value for +Inf: the largest `dtype` value at most
    `min(1e30, finfo(dtype).max, 0.5 * finfo(S).max * min(1, min_temperature))`, where S is
    the sampling dtype (float32, or float64 for float64 logits).

    65504 (float16's largest) for float16, about 1e30 for bfloat16 and float32 (SGLang's
    constant) at the default min_temperature: the row's top entry in its own dtype, finite
    after `logits.float() / T` for every allowed T.
    """
    compute = torch.finfo(sampling_dtype(dtype)).max
    value = min(1e30, torch.finfo(dtype).max, 0.5 * compute * min(1.0, min_temperature))
    # The largest value the dtype represents exactly that is <= the formula's, so storing it
    # cannot round up past the bound.
    stored = torch.tensor(value, dtype=torch.float64).to(dtype)
    while not math.isfinite(float(stored)) or float(stored) > value:
        stored = torch.nextafter(stored, torch.tensor(0.0, dtype=dtype))
    return float(stored)


def finite_after_temperature(value: float, dtype: torch.dtype, min_temperature: float) -> bool:
    """Whether `value`, stored in `dtype`, is finite there and stays finite after
    `/ min_temperature` in the sampling dtype (and so after any larger temperature)."""
    as_dtype = torch.tensor(value, dtype=dtype)
    compute = sampling_dtype(dtype)
    scaled = as_dtype.to(compute) / torch.tensor(min_temperature, dtype=compute)
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
            compute = sampling_dtype(dtype)
            limit = min(
                torch.finfo(dtype).max, torch.finfo(compute).max * min(1.0, min_temperature)
            )
            return (
                f"{key}={value:g} overflows {name} as stored or after division by "
                f"min_temperature={min_temperature:g} in {str(compute).removeprefix('torch.')} "
                f"(largest safe magnitude about {limit:.4g})"
            )
    return ""
