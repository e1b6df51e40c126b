"""Errors raised by guardrails.

`ConfigError` is the only error a deployment should ever see from guardrails, and only at
start-up: it lists every problem found in one go, each naming where the bad value came from
(an environment variable, a config-file key, an argument) and what would have been accepted.

A guarded call raises only for a tensor it refuses, untouched: `TensorTypeError` (a TypeError)
or `TensorValueError` (a ValueError), whose `reason` names the check (dtype, layout, shape,
device). Under zero-code attach those are counted under that reason instead of raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ConfigError", "Problem", "TensorTypeError", "TensorValueError"]


@dataclass(frozen=True)
class Problem:
    """One bad configuration value.

    `where` names the origin exactly as a user would search for it: `GUARDRAILS_SANITIZE`,
    `/etc/guardrails.toml: sites."sampler.logits".posinf_value`, `argument min_temperature`.
    """

    where: str
    message: str
    value: object = None
    accepted: str = ""

    def __str__(self) -> str:
        shown = "" if self.value is None else f"={self.value!r}"
        text = f"{self.where}{shown}: {self.message}"
        if self.accepted:
            text += f" (accepted: {self.accepted})"
        return text


class ConfigError(ValueError):
    """Invalid guardrails configuration; raised at start-up, never from a guarded call."""

    def __init__(self, problems: Iterable[Problem] | str) -> None:
        if isinstance(problems, str):
            problems = [Problem(where="guardrails", message=problems)]
        self.problems: tuple[Problem, ...] = tuple(problems)
        count = len(self.problems)
        header = f"invalid guardrails configuration ({count} problem{'s' if count != 1 else ''})"
        super().__init__(header + "".join(f"\n  - {p}" for p in self.problems))


class TensorTypeError(TypeError):
    """A guarded call refused a tensor of the wrong kind; the tensor was not modified.

    `reason`: "dtype" (not an accepted dtype, or not a tensor at all) or "layout" (sparse,
    nested)."""

    def __init__(self, message: str, reason: str = "dtype") -> None:
        super().__init__(message)
        self.reason = reason


class TensorValueError(ValueError):
    """A guarded call refused a tensor it cannot guard as given; the tensor was not modified.

    `reason`: "shape" (no vocab dimension, a vocabulary the kernel cannot hold), "device"
    (meta, or not the site's device) or "layout" (memory that overlaps itself)."""

    def __init__(self, message: str, reason: str = "shape") -> None:
        super().__init__(message)
        self.reason = reason
