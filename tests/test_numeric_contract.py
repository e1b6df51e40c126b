"""The numeric contract, property by property, on random tensors of every dtype and layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails import RowFlag
from guardrails.kernels.values import posinf_replacement
from guardrails.testing import fresh_guardrails
from tests.strategies import INT_VIEW, Case, logits_cases

MIN_T = 1e-5


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(INT_VIEW[x.dtype])


def _expected(original: torch.Tensor, *, count_neginf: bool = False) -> dict[str, object]:
    """The contract, written directly: what the tensor, flags and counts must become."""
    nan = original.isnan()
    pinf = original == math.inf
    ninf = original == -math.inf
    no_valid = (
        (nan | ninf).all(-1)
        if original.shape[-1]
        else torch.ones(original.shape[:-1], dtype=torch.bool)
    )
    healed = original.clone()
    healed[nan] = -math.inf
    healed[pinf] = posinf_replacement(original.dtype, MIN_T)
    healed[no_valid] = 0.0
    flags = (
        nan.any(-1).to(torch.uint8) * int(RowFlag.NAN)
        + pinf.any(-1).to(torch.uint8) * int(RowFlag.POSINF)
        + no_valid.to(torch.uint8) * int(RowFlag.NO_VALID_TOKEN)
    )
    nonfinite = nan.any(-1) | pinf.any(-1)
    if count_neginf:
        flags += ninf.any(-1).to(torch.uint8) * int(RowFlag.NEGINF)
        nonfinite |= ninf.any(-1)
    return {
        "healed": healed,
        "flags": flags.reshape(-1),
        "nan": int(nan.sum()),
        "posinf": int(pinf.sum()),
        "neginf": int(ninf.sum()) if count_neginf else 0,
        "rows_nonfinite": int(nonfinite.sum()),
        "rows_no_valid_token": int(no_valid.sum()),
    }


def _check_counts(
    guards: object, expected: dict[str, object], site: str = "sampler.logits"
) -> None:
    counts = guards.counts()  # type: ignore[attr-defined]
    for kind in ("nan", "posinf", "neginf", "rows_nonfinite", "rows_no_valid_token"):
        assert counts[(site, kind)] == expected[kind], kind
    assert counts[(site, "calls")] == 1


@given(logits_cases())
def test_heal_matches_contract_bit_for_bit(case: Case) -> None:
    x = case.tensor
    original = x.clone()
    expected = _expected(original)
    with fresh_guardrails() as guards:
        flags = guards.site("sampler.logits")(x)
        assert flags is not None
        assert flags.dtype == torch.uint8
        assert flags.device == x.device
        assert torch.equal(flags, expected["flags"]), case.description
        assert torch.equal(_bits(x), _bits(expected["healed"])), case.description  # type: ignore[arg-type]
        _check_counts(guards, expected)


@given(logits_cases(), st.sampled_from((MIN_T, 0.7, 1.0)))
def test_every_row_is_samplable_after_heal(case: Case, temperature: float) -> None:
    x = case.tensor
    with fresh_guardrails() as guards:
        guards.site("sampler.logits")(x)
    if x.numel() == 0:
        return
    probs = torch.softmax(x.float().reshape(-1, x.shape[-1]) / temperature, dim=-1)
    ids = torch.multinomial(probs, 1)
    assert bool(((ids >= 0) & (ids < x.shape[-1])).all())


@given(logits_cases(max_abs=None), st.sampled_from((MIN_T, 0.7, 1.0)))
def test_replaced_entries_stay_finite_after_temperature_in_own_dtype(
    case: Case, temperature: float
) -> None:
    x = case.tensor
    bad = ~torch.isfinite(x)
    with fresh_guardrails() as guards:
        guards.site("sampler.logits")(x)
    scaled = x / torch.tensor(temperature, dtype=x.dtype)
    replaced = scaled[bad]
    assert not bool(replaced.isnan().any())
    assert not bool((replaced == math.inf).any())


@given(logits_cases(max_abs=None))
def test_finite_values_are_never_changed_even_extreme_ones(case: Case) -> None:
    x = case.tensor
    original = x.clone()
    with fresh_guardrails() as guards:
        guards.site("sampler.logits")(x)
    finite = torch.isfinite(original)
    no_valid = (~torch.isfinite(original) & (original.isnan() | (original == -math.inf))).all(-1)
    keep = finite & ~no_valid.unsqueeze(-1)
    assert torch.equal(_bits(x)[keep], _bits(original)[keep])


@given(logits_cases())
def test_sanitize_false_detects_flags_counts_and_never_writes(case: Case) -> None:
    x = case.tensor
    original = x.clone()
    expected = _expected(original)
    with fresh_guardrails(sanitize=False) as guards:
        flags = guards.site("sampler.logits")(x)
        assert torch.equal(_bits(x), _bits(original))  # NaN payloads included
        assert torch.equal(flags, expected["flags"])
        _check_counts(guards, expected)


@given(logits_cases())
def test_count_neginf_site_counts_and_flags_but_keeps_neginf(case: Case) -> None:
    x = case.tensor
    original = x.clone()
    expected = _expected(original, count_neginf=True)
    with fresh_guardrails(sites={"model.logits": {"count_neginf": True}}) as guards:
        flags = guards.site("model.logits")(x)
        assert torch.equal(flags, expected["flags"])
        assert torch.equal(_bits(x), _bits(expected["healed"]))  # type: ignore[arg-type]
        _check_counts(guards, expected, site="model.logits")


@given(logits_cases(dtypes=(torch.float32,)))
def test_explicit_replacement_values_are_used(case: Case) -> None:
    x = case.tensor
    original = x.clone()
    site_config = {"nan_value": -1e30, "posinf_value": 1e30, "dtypes": ["float32"]}
    with fresh_guardrails(sites={"sampler.logits": site_config}) as guards:
        guards.site("sampler.logits")(x)
    nan = original.isnan()
    no_valid = (nan | (original == -math.inf)).all(-1, keepdim=True).expand_as(x)
    assert bool((x[nan & ~no_valid] == torch.tensor(-1e30, dtype=torch.float32)).all())
    assert bool((x[(original == math.inf) & ~no_valid] == torch.tensor(1e30)).all())
    assert bool((x[no_valid] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_posinf_replacement_follows_the_formula(dtype: torch.dtype) -> None:
    value = posinf_replacement(dtype, MIN_T)
    formula = min(1e30, 0.5 * torch.finfo(dtype).max * MIN_T)
    assert value <= formula
    assert value >= formula * (1 - 2 * torch.finfo(dtype).eps)
    stored = torch.tensor(value, dtype=dtype)
    assert float(stored) == value
    assert bool(torch.isfinite(stored / torch.tensor(MIN_T, dtype=dtype)))
