"""The oracle itself: hand-written cases with their answers worked out by hand, and the
contract's invariants on random tensors, so that the oracle cannot silently agree with a
broken kernel. Nothing here calls guardrails."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.contract import oracle
from tests.contract.oracle import NAN, NEGINF, NO_VALID_TOKEN, OOB_TOKEN, POSINF
from tests.contract.strategies import ALL_DTYPES, Case, logits_cases

INF = math.inf
# float32 holds 1e30 as 1.0000000150e30, above the bound: one step (2**76) below it instead.
P32 = 13234889 * 2.0**76
ZERO_COUNTS = dict.fromkeys(oracle.LOGITS_COUNTS, 0)

# -- the +Inf replacement -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "min_temperature", "value"),
    [
        (torch.float32, 1e-5, P32),
        (torch.bfloat16, 1e-5, 201 * 2.0**92),  # 8-bit significands: steps of 2**92 there
        (torch.float16, 1e-5, 65504.0),  # float16's largest: 6.55e9 after / 1e-5 in float32
        (torch.float16, 0.7, 65504.0),
        (torch.float16, 2.0, 65504.0),
        # 0.5 * finfo(float32).max * 1e-33 = 170141.1733...; float32 steps of 2**-6 there
        (torch.float32, 1e-33, 170141.171875),
        (torch.float64, 1e-5, 1e30),
    ],
    ids=str,
)
def test_default_posinf_value_worked_out_by_hand(
    dtype: torch.dtype, min_temperature: float, value: float
) -> None:
    assert oracle.default_posinf_value(dtype, min_temperature) == value


# -- logits rows ----------------------------------------------------------------------------


def _counts(**nonzero: int) -> dict[str, int]:
    return {**ZERO_COUNTS, **nonzero}


ROWS = {
    "nan_and_posinf_healed_neginf_kept": (
        [1.5, math.nan, INF, -INF],
        {},
        [1.5, -INF, P32, -INF],
        NAN | POSINF,
        _counts(nan=1, posinf=1, rows_nonfinite=1),
    ),
    "counted_neginf_flagged_and_kept": (
        [1.5, math.nan, INF, -INF],
        {"count_neginf": True},
        [1.5, -INF, P32, -INF],
        NAN | POSINF | NEGINF,
        _counts(nan=1, posinf=1, neginf=1, rows_nonfinite=1),
    ),
    "neginf_mask_is_not_a_fault": ([-INF, 0.25, -INF], {}, [-INF, 0.25, -INF], 0, _counts()),
    "neginf_mask_counted": (
        [-INF, 0.25, -INF],
        {"count_neginf": True},
        [-INF, 0.25, -INF],
        NEGINF,
        _counts(neginf=2, rows_nonfinite=1),
    ),
    "no_valid_entry_written_uniform": (
        [math.nan, -INF, math.nan],
        {},
        [0.0, 0.0, 0.0],
        NAN | NO_VALID_TOKEN,
        _counts(nan=2, rows_nonfinite=1, rows_no_valid_token=1),
    ),
    "all_neginf_has_no_valid_entry": (
        [-INF, -INF],
        {},
        [0.0, 0.0],
        NO_VALID_TOKEN,
        _counts(rows_no_valid_token=1),
    ),
    "posinf_is_a_valid_entry": (
        [math.nan, INF],
        {},
        [-INF, P32],
        NAN | POSINF,
        _counts(nan=1, posinf=1, rows_nonfinite=1),
    ),
    "extreme_finite_values_kept": (
        [-0.0, 2.0**-149, 3.4028234663852886e38, math.nan],
        {},
        [-0.0, 2.0**-149, 3.4028234663852886e38, -INF],
        NAN,
        _counts(nan=1, rows_nonfinite=1),
    ),
    "configured_values": (
        [math.nan, INF, 2.0],
        {"nan_value": -1e30, "posinf_value": 1e30},
        [-1.0000000150474662e30, 1.0000000150474662e30, 2.0],  # float32 rounds 1e30 up
        NAN | POSINF,
        _counts(nan=1, posinf=1, rows_nonfinite=1),
    ),
}


@pytest.mark.parametrize(("row", "settings", "healed", "flag", "counts"), ROWS.values(), ids=ROWS)
def test_logits_row_worked_out_by_hand(
    row: list[float],
    settings: dict[str, object],
    healed: list[float],
    flag: int,
    counts: dict[str, int],
) -> None:
    got = oracle.expected_logits(torch.tensor([row]), **settings)  # type: ignore[arg-type]
    assert torch.equal(got.bits, oracle.bits(torch.tensor([healed])))  # -0.0 and +0.0 apart
    assert got.flags.tolist() == [flag]
    assert got.counts == counts


def test_configured_values_are_stored_as_the_dtype_rounds_them() -> None:
    x = torch.tensor([[math.nan, INF, 2.0]], dtype=torch.float16)
    got = oracle.expected_logits(x, nan_value=-0.3, posinf_value=0.3)
    # 0.3 lies 0.8 of the way from 1228 * 2**-12 to 1229 * 2**-12: it rounds up.
    want = torch.tensor([[-1229 * 2.0**-12, 1229 * 2.0**-12, 2.0]], dtype=torch.float16)
    assert torch.equal(got.bits, oracle.bits(want))


def test_detect_only_keeps_every_bit_and_flags_the_same() -> None:
    x = torch.tensor([[math.nan, INF, -INF, 2.0], [math.nan, math.nan, -INF, -INF]])
    x.view(torch.int32)[0, 0] = 0x7FC0_1234  # a NaN with a payload
    got = oracle.expected_logits(x, sanitize=False)
    assert torch.equal(got.bits, x.view(torch.int32))
    assert got.flags.tolist() == [NAN | POSINF, NAN | NO_VALID_TOKEN]
    assert got.counts == _counts(nan=3, posinf=1, rows_nonfinite=2, rows_no_valid_token=1)


def test_rows_are_the_leading_dims_in_order() -> None:
    x = torch.zeros(2, 2, 3)
    x[1, 0, 2] = math.nan
    x[0, 1, 0] = INF
    assert oracle.expected_logits(x).flags.tolist() == [0, POSINF, NAN, 0]


def test_rows_of_an_empty_vocabulary_have_no_valid_token() -> None:
    got = oracle.expected_logits(torch.empty(3, 0))
    assert got.flags.tolist() == [NO_VALID_TOKEN] * 3
    assert got.counts == _counts(rows_no_valid_token=3)


def test_no_rows_flag_and_count_nothing() -> None:
    got = oracle.expected_logits(torch.empty(0, 5))
    assert got.flags.tolist() == []
    assert got.counts == ZERO_COUNTS


# -- token ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "vocab", "settings", "healed", "flags", "counts"),
    [
        ([3, 10, -1, 9, 0], 10, {}, [3, 0, 0, 9, 0], [0, OOB_TOKEN, OOB_TOKEN, 0, 0], (2, 2)),
        ([[1, 2, 3], [1, 99, 99]], 50, {}, [1, 2, 3, 1, 0, 0], [0, OOB_TOKEN], (2, 1)),
        (12, 10, {}, [0], [OOB_TOKEN], (1, 1)),
        ([5, 50], 10, {"replacement_id": 7}, [5, 7], [0, OOB_TOKEN], (1, 1)),
        ([5, 50], 10, {"sanitize": False}, [5, 50], [0, OOB_TOKEN], (1, 1)),
    ],
    ids=["per_id", "per_row", "zero_dim", "replacement_id", "detect_only"],
)
def test_token_ids_worked_out_by_hand(
    ids: object,
    vocab: int,
    settings: dict[str, object],
    healed: list[int],
    flags: list[int],
    counts: tuple[int, int],
) -> None:
    got = oracle.expected_token_ids(torch.tensor(ids), vocab, **settings)  # type: ignore[arg-type]
    assert got.ids == healed
    assert got.flags == flags
    assert got.counts == {"oob_token": counts[0], "rows_oob_token": counts[1]}


def test_token_rows_without_ids_are_not_flagged() -> None:
    got = oracle.expected_token_ids(torch.empty(3, 0, dtype=torch.int64), 10)
    assert (got.flags, got.counts) == ([0, 0, 0], {"oob_token": 0, "rows_oob_token": 0})


# -- the contract's invariants, on the oracle's answers -----------------------------------

ANY_LOGITS = st.one_of(
    logits_cases(dtypes=ALL_DTYPES), logits_cases(dtypes=ALL_DTYPES, max_abs=None)
)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


@given(ANY_LOGITS)
def test_the_oracle_never_changes_a_finite_value_of_a_row_with_a_valid_entry(case: Case) -> None:
    before = _rows(oracle.bits(case.tensor).contiguous())
    values = before.view(case.tensor.dtype)
    after = _rows(oracle.expected_logits(case.tensor).bits)
    has_valid = (values.isfinite() | (values == INF)).any(-1, keepdim=True)
    keep = values.isfinite() & has_valid
    assert torch.equal(after[keep], before[keep]), case.description


@given(ANY_LOGITS, st.booleans())
def test_the_oracle_leaves_no_nan_or_posinf_and_writes_no_neginf(
    case: Case, count_neginf: bool
) -> None:
    dtype = case.tensor.dtype
    before = _rows(case.tensor)
    after = _rows(oracle.expected_logits(case.tensor, count_neginf=count_neginf).bits.view(dtype))
    assert not bool(after.isnan().any()), case.description
    assert not bool((after == INF).any()), case.description
    # Every -inf afterwards was -inf before (or a NaN, the default nan_value): never a finite.
    became = (after == -INF) & ~((before == -INF) | before.isnan())
    assert not bool(became.any()), case.description


@given(ANY_LOGITS, st.booleans())
def test_detect_only_changes_no_bit_and_flags_and_counts_as_healing_does(
    case: Case, count_neginf: bool
) -> None:
    healed = oracle.expected_logits(case.tensor, count_neginf=count_neginf)
    detected = oracle.expected_logits(case.tensor, count_neginf=count_neginf, sanitize=False)
    assert torch.equal(detected.bits, oracle.bits(case.tensor).contiguous())
    assert torch.equal(detected.flags, healed.flags)
    assert detected.counts == healed.counts


@given(ANY_LOGITS, st.booleans())
def test_the_oracles_counts_agree_with_its_flags(case: Case, count_neginf: bool) -> None:
    got = oracle.expected_logits(case.tensor, count_neginf=count_neginf)
    flags = got.flags.tolist()
    faults = NAN | POSINF | (NEGINF if count_neginf else 0)
    assert got.counts["rows_nonfinite"] == sum(1 for f in flags if f & faults)
    assert got.counts["rows_no_valid_token"] == sum(1 for f in flags if f & NO_VALID_TOKEN)
    assert len(flags) == math.prod(case.tensor.shape[:-1])


@given(logits_cases(), st.sampled_from((oracle.MIN_TEMPERATURE, 0.7, 1.0)))
def test_every_row_is_samplable_after_the_heal(case: Case, temperature: float) -> None:
    x = case.tensor
    if x.numel() == 0:
        return
    healed = oracle.expected_logits(x).bits.view(x.dtype)
    probs = torch.softmax(_rows(healed).float() / temperature, dim=-1)
    ids = torch.multinomial(probs, 1)
    assert bool(((ids >= 0) & (ids < x.shape[-1])).all())


@given(
    logits_cases(dtypes=ALL_DTYPES, max_abs=None),
    st.sampled_from((oracle.MIN_TEMPERATURE, 0.7, 1.0)),
)
def test_replaced_entries_stay_finite_after_temperature_in_the_sampling_dtype(
    case: Case, temperature: float
) -> None:
    x = case.tensor
    bad = ~torch.isfinite(x)
    healed = oracle.expected_logits(x).bits.view(x.dtype)
    # Engines divide in float32 (vLLM's sampler and SGLang's logits processor upcast first).
    sampling = torch.float64 if x.dtype == torch.float64 else torch.float32
    scaled = healed.to(sampling) / temperature
    replaced = scaled[bad]
    assert not bool(replaced.isnan().any())
    assert not bool((replaced == INF).any())


@given(logits_cases(dtypes=ALL_DTYPES, max_abs=1e29))
def test_a_healed_posinf_stays_the_top_entry_of_its_row(case: Case) -> None:
    # Greedy sampling still picks a +Inf entry (SGLang's 1e30 and transformers' finfo.max
    # keep it on top too); float16's 65504 is its largest value, so nothing outranks it.
    # Elsewhere the value is capped at 1e30: logits beyond that are not ordinary ones.
    x = case.tensor
    if x.numel() == 0:
        return
    healed = _rows(oracle.expected_logits(x).bits.view(x.dtype))
    was_posinf = _rows(x.contiguous()) == INF
    for row, posinf in zip(healed, was_posinf, strict=True):
        if bool(posinf.any()):
            top = row.max()
            assert bool((row[posinf] == top).all())
            assert bool(torch.isfinite(top))
