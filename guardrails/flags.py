"""Row flags and the names of the counts every site keeps.

A guarded call returns one uint8 per logits row; its bits say what was found in that row.
Counts are kept per (site, kind); the kind names below are the keys of
`Guardrails.counts()` and, for values and rows, the label values of the Prometheus metrics.
"""

from __future__ import annotations

import enum

__all__ = [
    "LOGITS_SLOTS",
    "TOKEN_SLOTS",
    "CountKind",
    "RowFlag",
]


class RowFlag(enum.IntFlag):
    """Bits of a row flag (one uint8 per row)."""

    NAN = 1
    POSINF = 2
    NEGINF = 4  # only at sites that count -inf (count_neginf = true)
    NO_VALID_TOKEN = 8  # every entry NaN or -inf: the row was written uniform; abort the request
    OOB_TOKEN = 16  # a token id outside [0, vocab_size)

    @classmethod
    def parse(cls, names: str | list[str] | tuple[str, ...]) -> RowFlag:
        """`"nan,no_valid_token"` or `["NAN", "NO_VALID_TOKEN"]` -> a combined flag."""
        if isinstance(names, str):
            names = [n for n in names.split(",") if n.strip()]
        flag = cls(0)
        for name in names:
            key = name.strip().upper()
            if key == "ANY":
                flag |= ANY_FLAG
                continue
            try:
                flag |= cls[key]
            except KeyError:
                accepted = ", ".join(str(m.name).lower() for m in cls) + ", any"
                raise ValueError(f"unknown row flag {name!r}; accepted: {accepted}") from None
        return flag


ANY_FLAG = (
    RowFlag.NAN | RowFlag.POSINF | RowFlag.NEGINF | RowFlag.NO_VALID_TOKEN | RowFlag.OOB_TOKEN
)


class CountKind(enum.StrEnum):
    """What a site counts. Values are counted per entry, rows per flagged row."""

    NAN = "nan"
    POSINF = "posinf"
    NEGINF = "neginf"
    ROWS_NONFINITE = "rows_nonfinite"
    ROWS_NO_VALID_TOKEN = "rows_no_valid_token"
    OOB_TOKEN = "oob_token"
    ROWS_OOB_TOKEN = "rows_oob_token"
    CALLS = "calls"


# Layout of the int64 device buffer each site accumulates into. The kernels write by index,
# the reporter reads by index; this is the one place that fixes the order.
LOGITS_SLOTS: tuple[CountKind, ...] = (
    CountKind.NAN,
    CountKind.POSINF,
    CountKind.NEGINF,
    CountKind.ROWS_NONFINITE,
    CountKind.ROWS_NO_VALID_TOKEN,
)
TOKEN_SLOTS: tuple[CountKind, ...] = (CountKind.OOB_TOKEN, CountKind.ROWS_OOB_TOKEN)
