"""The numeric contract of logits sites, held against the oracle for every implementation.

Each implementation (`tests/contract/guards.py`: the reference kernel, the CPU kernel with
default and tiny chunks, the Triton kernel under its interpreter, cut three ways, and the
public `site(x)` path) is driven through a sequence of calls in one site mode (sanitize or
detect only, -inf counted or not, default or configured replacement values, several
`min_temperature`s), on random tensors of every dtype, rank and layout. Each call must
write exactly the oracle's bits, return its flags and add its counts. The contract's rules
themselves are stated, and checked, in `tests/contract/oracle.py` and `test_oracle.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails import RowFlag
from guardrails.kernels.values import posinf_replacement
from tests.contract import oracle
from tests.contract.guards import IMPLEMENTATIONS, TRITON, Mode, open_driver
from tests.contract.strategies import ALL_DTYPES, Case, logits_cases

# Configured replacement values (nan_value = -v, posinf_value = v) with a min_temperature at
# which the settings accept them; none of them is exactly representable in every dtype, so
# every implementation must round them as the dtype stores them.
CONFIGURED = ((1e30, 1e-5), (6.0e4 + 1.0, 1.0), (0.3, 1e-5))
CONFIGURED_FLOAT16 = tuple(c for c in CONFIGURED if c[0] < 65504)  # 1e30: no float16 site
MIN_TEMPERATURES = (1e-5, 0.7, 1.0, 2.0)


def cases(name: str) -> st.SearchStrategy[Case]:
    """Tensors for implementation `name`, up to 4 x 4 rows: the interpreter runs one program
    at a time, so the Triton kernel gets rows of up to 100 columns; the others get
    vocabularies up to 3,000, where the CPU kernel's default chunks come into play."""
    if name in TRITON:
        vocab = st.integers(0, 100)
    else:
        vocab = st.one_of(st.integers(0, 40), st.integers(41, 3000))
    return st.one_of(
        *(
            logits_cases(dtypes=ALL_DTYPES, vocab=vocab, max_rows=4, max_abs=max_abs)
            for max_abs in (1e4, None)  # moderate logits; any finite value, subnormals included
        )
    )


@st.composite
def modes(draw: st.DrawFn, dtypes: set[torch.dtype]) -> Mode:
    sanitize, count_neginf = draw(st.booleans()), draw(st.booleans())
    if draw(st.booleans()):
        value, min_t = draw(
            st.sampled_from(CONFIGURED_FLOAT16 if torch.float16 in dtypes else CONFIGURED)
        )
        return Mode(sanitize, count_neginf, -value, value, min_t)
    return Mode(sanitize, count_neginf, min_temperature=draw(st.sampled_from(MIN_TEMPERATURES)))


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The implementation's name, and what opening it needs (Triton's interpreted code)."""
    name = request.param
    code = request.getfixturevalue("triton_device_code") if name in TRITON else None
    return {"name": name, "triton_device_code": code}


@given(data=st.data())
def test_every_call_writes_flags_and_counts_what_the_oracle_says(
    implementation: dict[str, Any], data: st.DataObject
) -> None:
    name = implementation["name"]
    # Two calls for the interpreted kernel (its scratch reset between calls), three elsewhere.
    longest = 2 if name in TRITON else 3
    calls = data.draw(st.lists(cases(name), min_size=1, max_size=longest), label="calls")
    dtypes = {case.tensor.dtype for case in calls}
    mode = data.draw(modes(dtypes), label="mode")
    # A site accepts every dtype by default; with configured values, only those they fit.
    accepted = tuple(sorted(dtypes, key=str)) if mode.posinf_value is not None else None
    with open_driver(
        name, mode, dtypes=accepted, triton_device_code=implementation["triton_device_code"]
    ) as guard:
        for case in calls:
            x = case.tensor
            expected = mode.expected(x)
            outcome = guard(x)
            assert outcome.flags.dtype == torch.uint8
            assert torch.equal(outcome.flags, expected.flags), case.description
            assert outcome.counts == expected.counts, case.description
            assert expected.holds_for(x), case.description


@pytest.mark.parametrize("min_temperature", MIN_TEMPERATURES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_default_posinf_value_is_the_largest_below_the_bound(
    dtype: torch.dtype, min_temperature: float
) -> None:
    # The kernels take their +Inf value from the site, which takes it from this function.
    value = posinf_replacement(dtype, min_temperature)
    assert value == oracle.default_posinf_value(dtype, min_temperature)
    assert float(torch.tensor(value, dtype=dtype)) == value  # stored exactly


def test_row_flag_bits_are_the_contracts() -> None:
    assert int(RowFlag.NAN) == oracle.NAN
    assert int(RowFlag.POSINF) == oracle.POSINF
    assert int(RowFlag.NEGINF) == oracle.NEGINF
    assert int(RowFlag.NO_VALID_TOKEN) == oracle.NO_VALID_TOKEN
    assert int(RowFlag.OOB_TOKEN) == oracle.OOB_TOKEN
