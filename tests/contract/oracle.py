"""The numeric contract, written out as an oracle: what a guarded call must leave in the tensor,
return as row flags and add to the counts.

Written from the contract, not from the package: nothing here imports guardrails, so the
package's reference kernel is one implementation under test like the others.
`tests/contract/test_oracle.py` holds the oracle itself to hand-written cases and to the
contract's invariants.

Logits, per row of `[..., vocab]` (any leading shape, any strides):

- NaN becomes `nan_value` (default -inf), counted `nan`, flag NAN;
- +Inf becomes the +Inf replacement (below), counted `posinf`, flag POSINF;
- -Inf is left as it is; counted `neginf` with flag NEGINF only where the site counts it;
- a row with no valid entry (no finite value and no +Inf: all NaN/-Inf, or vocab 0) is
  written all +0.0 instead, flag NO_VALID_TOKEN, counted in `rows_no_valid_token`;
- `rows_nonfinite` counts the rows holding NaN or +Inf (or -Inf where counted);
- finite values never change, bit for bit; with `sanitize=False` nothing is written at all
  (NaN payloads included) and the flags and counts are the same.

The +Inf replacement, unless configured: the largest value the dtype represents that is
<= min(1e30, 0.5 * finfo(dtype).max * min(1, min_temperature)). Configured replacement values
are stored as the dtype rounds them (to nearest).

Token ids: an id outside [0, vocab_size) is counted `oob_token`, its row flagged OOB_TOKEN
(a row per id for 0-d and 1-d ids, per `[..., k]` slice otherwise) and counted in
`rows_oob_token`, and replaced by `replacement_id` when sanitizing.

Everything is computed on integer views of the bits, so NaN payloads, -0.0 and subnormals
are compared exactly and no float arithmetic can quietly change a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The row flag bits (the contract's numbers; RowFlag must carry the same).
NAN, POSINF, NEGINF, NO_VALID_TOKEN, OOB_TOKEN = 1, 2, 4, 8, 16
# The per-call counts of a logits site, and of a token-id site.
LOGITS_COUNTS = ("nan", "posinf", "neginf", "rows_nonfinite", "rows_no_valid_token")
TOKEN_COUNTS = ("oob_token", "rows_oob_token")
MIN_TEMPERATURE = 1e-5  # the default `min_temperature`
INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(x: torch.Tensor) -> torch.Tensor:
    """`x`'s values as integers of the same width: equal bits, equal integers."""
    return x.detach().view(INT_VIEW[x.dtype])


def stored(value: float, dtype: torch.dtype) -> float:
    """`value` as `dtype` stores it (rounded to nearest)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def largest_at_most(bound: float, dtype: torch.dtype) -> float:
    """The largest value `dtype` represents that is <= `bound` (a positive finite float)."""
    cell = torch.tensor([bound], dtype=torch.float64).to(dtype)  # nearest: at most one above
    while not math.isfinite(float(cell)) or float(cell) > bound:
        cell = (cell.view(INT_VIEW[dtype]) - 1).view(dtype)  # one step down (cell > 0)
    return float(cell)


def default_posinf_value(dtype: torch.dtype, min_temperature: float = MIN_TEMPERATURE) -> float:
    """What +Inf becomes unless a value is configured."""
    # Top of its own dtype (greedy still picks it), finite after the temperature step the
    # engines run in float32 (float64 for float64 logits).
    sampling = torch.float64 if dtype == torch.float64 else torch.float32
    bound = min(
        1e30,
        torch.finfo(dtype).max,
        0.5 * torch.finfo(sampling).max * min(1.0, min_temperature),
    )
    return largest_at_most(bound, dtype)


@dataclass(frozen=True)
class Expected:
    """What one guarded call must produce."""

    bits: torch.Tensor  # the tensor afterwards, as `bits()` of a contiguous copy
    flags: torch.Tensor  # uint8, one per row
    counts: dict[str, int]  # what the call adds to each count

    def holds_for(self, x: torch.Tensor) -> bool:
        """Whether `x` (after the call) holds exactly the expected values, bit for bit."""
        return torch.equal(bits(x).cpu(), self.bits)


class _Rows:
    """`x` as `[rows, vocab]` bits, and what each entry is."""

    def __init__(self, x: torch.Tensor) -> None:
        self.dtype = x.dtype
        self.shape = tuple(x.shape)
        lead, vocab = self.shape[:-1], self.shape[-1]
        # A view of `x` where it can be one: read here, before the call; never written.
        self.bits = bits(x).cpu().contiguous().reshape(math.prod(lead), vocab)
        values = self.bits.view(self.dtype)
        self.nan = values.isnan()
        self.pinf = values == math.inf
        self.ninf = values == -math.inf
        valid = ~(self.nan | self.ninf)  # finite or +Inf: something the row can be sampled from
        self.no_valid = ~valid.any(-1)  # any() of an empty row is False: vocab 0 has none

    def flags_and_counts(self, count_neginf: bool) -> tuple[torch.Tensor, dict[str, int]]:
        row_nan, row_pinf = self.nan.any(-1), self.pinf.any(-1)
        row_ninf = self.ninf.any(-1) if count_neginf else torch.zeros_like(row_nan)
        flags = (
            row_nan.to(torch.uint8) * NAN
            + row_pinf.to(torch.uint8) * POSINF
            + row_ninf.to(torch.uint8) * NEGINF
            + self.no_valid.to(torch.uint8) * NO_VALID_TOKEN
        )
        values = torch.stack(
            [
                self.nan.sum(),
                self.pinf.sum(),
                self.ninf.sum() if count_neginf else torch.zeros((), dtype=torch.int64),
                (row_nan | row_pinf | row_ninf).sum(),
                self.no_valid.sum(),
            ]
        )
        return flags, dict(zip(LOGITS_COUNTS, values.tolist(), strict=True))


def expected_logits(
    x: torch.Tensor,
    *,
    sanitize: bool = True,
    count_neginf: bool = False,
    nan_value: float = -math.inf,
    posinf_value: float | None = None,
    min_temperature: float = MIN_TEMPERATURE,
) -> Expected:
    """The contract's outcome of guarding logits `x` ([..., vocab]), computed before the call."""
    rows = _Rows(x)
    dtype = x.dtype
    after = rows.bits.clone()
    if sanitize:
        posinf = posinf_value
        if posinf is None:
            posinf = default_posinf_value(dtype, min_temperature)
        after[rows.nan] = _bits_of(stored(nan_value, dtype), dtype)
        after[rows.pinf] = _bits_of(stored(posinf, dtype), dtype)
        after[rows.no_valid] = 0  # +0.0 everywhere: uniform
    flags, counts = rows.flags_and_counts(count_neginf)
    return Expected(after.reshape(rows.shape), flags, counts)


def expected_flags_and_counts(
    x: torch.Tensor, *, count_neginf: bool = False
) -> tuple[torch.Tensor, dict[str, int]]:
    """`expected_logits(x)`'s row flags and counts without the healed copy (the soak asks
    this of every dirty call, from several threads)."""
    return _Rows(x).flags_and_counts(count_neginf)


def _bits_of(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor([value], dtype=dtype).view(INT_VIEW[dtype])[0])


@dataclass(frozen=True)
class ExpectedIds:
    """What one guarded call on token ids must produce."""

    ids: list[int]  # the ids afterwards, flattened
    flags: list[int]  # one per row
    counts: dict[str, int]


def expected_token_ids(
    ids: torch.Tensor, vocab_size: int, *, sanitize: bool = True, replacement_id: int = 0
) -> ExpectedIds:
    """The contract's outcome of guarding token ids `ids`, in plain Python."""
    values = [int(v) for v in ids.reshape(-1).tolist()]
    oob = [not 0 <= v < vocab_size for v in values]
    if ids.dim() <= 1:
        row_flags = [OOB_TOKEN if bad else 0 for bad in oob]
    else:
        k = ids.shape[-1]
        rows = math.prod(ids.shape[:-1])
        row_flags = [OOB_TOKEN if any(oob[r * k : (r + 1) * k]) else 0 for r in range(rows)]
    healed = [replacement_id if bad and sanitize else v for v, bad in zip(values, oob, strict=True)]
    counts = dict(zip(TOKEN_COUNTS, (sum(oob), sum(1 for f in row_flags if f)), strict=True))
    return ExpectedIds(healed, row_flags, counts)
