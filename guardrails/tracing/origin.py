"""Where a non-finite value was born: a small pure function of the latched rows.

The rule: among the rows latched at the earliest latched step, the traced modules whose
input was finite and whose output was not; of those, the innermost (a module none of whose
traced descendants is also such a module). A value made by plain code inside a module's
`forward` (not by a traced submodule) is that module's: its traced children either stayed
finite or saw a non-finite input. Ties (two siblings born in one step) go to the first
module in `named_modules()` order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["KINDS", "Origin", "find_origin", "kind_of", "peak_ratios"]

# The kind an output's bits name, nan first: a NaN hides any Inf in a min/max read.
KINDS: Final = ((1, "nan"), (2, "posinf"), (4, "neginf"))


@dataclass(frozen=True)
class Origin:
    module: str
    kind: str
    dtype: str | None
    step: int


def kind_of(bits: float) -> str | None:
    value = int(bits)
    for bit, name in KINDS:
        if value & bit:
            return name
    return None


def _descends(child: str, parent: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


def find_origin(
    names: Sequence[str], rows: Sequence[Sequence[float]], dtypes: Sequence[str | None]
) -> Origin | None:
    """The origin in `rows` (the state's module rows as lists, see `guardrails.tracing.ops`),
    or None when nothing latched or every latched module's input was already non-finite
    (the value came from outside the traced modules)."""
    latched = [i for i, row in enumerate(rows) if row[4] > 0]
    if not latched:
        return None
    first = min(rows[i][4] for i in latched)
    born = [i for i in latched if rows[i][4] == first and int(rows[i][5]) == 0]
    inner = [i for i in born if not any(j != i and _descends(names[j], names[i]) for j in born)]
    if not inner:
        return None
    i = inner[0]
    kind = kind_of(rows[i][6]) or "nan"
    return Origin(module=names[i], kind=kind, dtype=dtypes[i], step=int(first))


def peak_ratios(
    names: Sequence[str], rows: Sequence[Sequence[float]], maxima: Sequence[float | None]
) -> list[tuple[str, float]]:
    """(module, largest finite |output| / its dtype's largest finite value), largest first;
    modules never probed with a floating output are left out."""
    out = []
    for name, row, top in zip(names, rows, maxima, strict=True):
        if top:
            out.append((name, row[7] / top))
    out.sort(key=lambda pair: -pair[1])
    return out
