"""Errors raised by guardrails.

`ConfigError` is the only error a deployment should ever see from guardrails, and only at
start-up: it lists every problem found in one go, each naming where the bad value came from
(an environment variable, a config-file key, an argument) and what would have been accepted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ConfigError", "Problem"]


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
