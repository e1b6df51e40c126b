"""`AttachPoint`: one parsed attach point (site, target, tensor reference, kind), and the
`AttachError` raised when it does not fit the code it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from guardrails.exceptions import ConfigError, Problem
from guardrails.settings import AttachSettings
from guardrails.settings.targets import Ref, Target, parse_ref, parse_target

__all__ = ["AttachError", "AttachPoint"]


class AttachError(ConfigError):
    """An attach point that cannot be applied: the message names the target."""


@dataclass(frozen=True)
class AttachPoint:
    """One parsed attach point; `origin` names where it was declared (for messages)."""

    site: str
    target: Target
    tensor: Ref
    kind: Literal["logits", "token_ids"] = "logits"
    vocab_size: int | None = None
    vocab_size_from: Ref | None = None
    when: str | None = None  # a requirement such as "sglang>=0.5.14" (see install)
    origin: str = "attach target"
    expect_calls: bool = True  # False: only some engine steps call it (see _watched)

    @classmethod
    def from_settings(cls, entry: AttachSettings, origin: str = "attach target") -> AttachPoint:
        return cls(
            site=entry.site,
            target=parse_target(entry.target),
            tensor=parse_ref(entry.tensor),
            kind=entry.kind,
            vocab_size=entry.vocab_size,
            vocab_size_from=None
            if entry.vocab_size_from is None
            else parse_ref(entry.vocab_size_from),
            when=entry.when,
            origin=origin,
            expect_calls=entry.expect_calls,
        )

    @classmethod
    def from_arguments(cls, **values: Any) -> AttachPoint:
        """Validate keyword arguments the way a `[[attach]]` entry is validated."""
        try:
            entry = AttachSettings(**values)
        except ValidationError as exc:
            raise ConfigError(
                Problem(
                    "argument " + ".".join(str(p) for p in err["loc"])
                    if err["loc"]
                    else "argument",
                    err["msg"],
                    err.get("input") if isinstance(err.get("input"), str | int) else None,
                )
                for err in exc.errors(include_url=False)
            ) from None
        return cls.from_settings(entry)

    @property
    def slot(self) -> tuple[str, str, str]:
        """The value this point guards: two points of one slot must never both apply (every
        call would be counted twice)."""
        return (str(self.target), self.site, str(self.tensor))

    @property
    def key(self) -> tuple[str, ...]:
        """The point itself: applying the same key twice returns the same handle, while
        points differing in `when` or the vocabulary are different points of one slot."""
        return (
            *self.slot,
            self.kind,
            str(self.vocab_size),
            str(self.vocab_size_from),
            str(self.when),
        )

    def error(self, message: str) -> AttachError:
        return AttachError([Problem(self.origin, message, str(self.target))])

    def __str__(self) -> str:
        return f"{self.site} <- {self.target} [{self.tensor}]"
