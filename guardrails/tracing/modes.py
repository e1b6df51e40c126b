"""Trace modes: `always`, `armed`, `every:N` (parsed once, at configuration)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["MODE_SYNTAX", "TraceMode", "parse_mode"]

MODE_SYNTAX: Final = "always, armed, or every:N with N an integer >= 1 (e.g. every:16)"


@dataclass(frozen=True)
class TraceMode:
    """`every` is 1 for `always`; `armed` probes nothing until a site's first hit."""

    name: str
    every: int = 1

    @property
    def armed(self) -> bool:
        return self.name == "armed"

    def __str__(self) -> str:
        return f"every:{self.every}" if self.name == "every" else self.name


def parse_mode(text: object) -> TraceMode:
    """The mode `text` names; ValueError naming the accepted spellings otherwise."""
    if isinstance(text, TraceMode):
        return text
    if not isinstance(text, str):
        raise ValueError(f"trace mode must be a string ({MODE_SYNTAX}), got {text!r}")
    value = text.strip().lower()
    if value in ("always", "armed"):
        return TraceMode(value)
    name, colon, count = value.partition(":")
    if name == "every" and colon:
        digits = count.strip()
        if digits.isascii() and digits.isdigit() and int(digits) >= 1:
            return TraceMode("every", int(digits))
    raise ValueError(f"invalid trace mode {text!r}: use {MODE_SYNTAX}")
