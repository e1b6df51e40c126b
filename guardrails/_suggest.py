"""The "did you mean" of every message that names something unknown (a settings key, a site,
a traced module): a floor every layer may import."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest"]


def closest(name: str, candidates: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the candidate closest to `name`, or "" when none is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""
