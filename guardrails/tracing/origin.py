"""Where a non-finite value was born: a small pure function of the latched rows.

The rows hold one episode (`guardrails.tracing.ops`): the modules whose output was non-finite
at its first step, with their input's and output's kinds. The candidates in that step:

1. a module whose output held NaN or +Inf while its input was finite (kind `nan`, `posinf`);
2. -inf is a value models write on purpose (attention masks, `log(0)`): it never starts an
   episode, and is a candidate (kind `neginf`) only where a NaN/+Inf followed from a -inf in
   that step (some module made one from an input whose only non-finite values were -inf):
   a module whose output held -inf (and no NaN/+Inf) while its input was finite, and that
   never wrote -inf in a step without NaN/+Inf. A mask writes -inf in every step and is
   never named; a negative float16 overflow writes it when things go wrong and is named as
   a positive one is.

The origin is the innermost candidate (none of its traced descendants is also one); among
several, a NaN/+Inf one before a -inf one, then the first in `named_modules()` order. A value
made by plain code inside a module's `forward` (not by a traced submodule) is that module's:
its traced children either stayed finite or saw a non-finite input. Nothing is named when
there is no candidate: every module non-finite at that step saw a non-finite input (the value
came from outside the traced modules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["KINDS", "Origin", "find_origin", "kind_of", "peak_ratios"]

# The kind an output's bits name, nan first: a NaN hides any Inf in a min/max read.
KINDS: Final = ((1, "nan"), (2, "posinf"), (4, "neginf"))
_NAN_OR_POSINF: Final = 3
_NEGINF: Final = 4
# The row's columns the rule reads (see `guardrails.tracing.ops`).
_FIRST, _IN_BITS, _OUT_BITS, _PEAK, _MASK = 4, 5, 6, 7, 8


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
    """The origin in `rows` (the state's module rows as lists, see `guardrails.tracing.ops`)
    by the rule of the module docstring, or None when nothing latched or nothing there was
    born in a traced module."""
    latched = [i for i, row in enumerate(rows) if row[_FIRST] > 0]
    if not latched:
        return None
    first = min(rows[i][_FIRST] for i in latched)
    at = [i for i in latched if rows[i][_FIRST] == first]
    ins = {i: int(rows[i][_IN_BITS]) for i in at}
    outs = {i: int(rows[i][_OUT_BITS]) for i in at}
    strong = [i for i in at if outs[i] & _NAN_OR_POSINF and ins[i] == 0]
    weak = []
    if any(outs[j] & _NAN_OR_POSINF and ins[j] == _NEGINF for j in at):
        weak = [j for j in at if outs[j] == _NEGINF and ins[j] == 0 and not rows[j][_MASK]]
    both = strong + weak
    inner = [i for i in both if not any(j != i and _descends(names[j], names[i]) for j in both)]
    if not inner:
        return None
    i = min(inner, key=lambda j: (j in weak, j))
    kind = kind_of(outs[i]) or "nan"
    return Origin(module=names[i], kind=kind, dtype=dtypes[i], step=int(first))


def peak_ratios(
    names: Sequence[str], rows: Sequence[Sequence[float]], maxima: Sequence[float | None]
) -> list[tuple[str, float]]:
    """(module, largest finite |output| / its dtype's largest finite value), largest first;
    modules never probed with a floating output are left out."""
    out = []
    for name, row, top in zip(names, rows, maxima, strict=True):
        if top:
            out.append((name, row[_PEAK] / top))
    out.sort(key=lambda pair: -pair[1])
    return out
