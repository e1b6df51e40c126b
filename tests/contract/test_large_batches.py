"""Large batches, fuzzed: the CPU kernel's chunked check held to the oracle for every dtype.

Below `_CHUNKED_CHECK_MIN` values a float32/bfloat16/float64 batch is proven clean by one plain
sum, and every other fuzzed tensor stays far below it; past it the check is per chunk of each
row and the exact work follows the chunks whose sums are not finite. Here `[16, 151936]`
batches (a real vocabulary, 2.4M values) carry a few bad values at random places, a few bad
whole rows and -inf masks, through the kernel as a site drives it and through `site(x)`. A
handful of cases each: every case is a few full passes over 2.4M values.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails.kernels._cpu import _CHUNKED_CHECK_MIN, CPU_KERNEL
from tests.budget import budget
from tests.contract.guards import KernelDriver, Mode, open_driver

ROWS, VOCAB = 16, 151936
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
VALUES = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf}

spots = st.tuples(
    st.integers(0, ROWS - 1), st.integers(0, VOCAB - 1), st.sampled_from(tuple(VALUES))
)
whole_rows = st.tuples(st.integers(0, ROWS - 1), st.sampled_from(("nan", "neginf", "mixed")))


def _batch(
    dtype: torch.dtype,
    seed: int,
    bad: list[tuple[int, int, str]],
    rows: list[tuple[int, str]],
    masks: int,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(ROWS, VOCAB, generator=gen) * 4 - 3).to(dtype)
    if masks:  # -inf masks in every row, as grammars and top-k leave them
        x[:, masks::97] = -math.inf
    for row, mode in rows:
        if mode == "mixed":
            pick = torch.rand(VOCAB, generator=gen) < 0.5
            x[row] = torch.where(pick, math.nan, -math.inf).to(dtype)
        else:
            x[row] = VALUES[mode]
    for row, col, kind in bad:
        x[row, col] = VALUES[kind]
    return x


@pytest.mark.parametrize("driver", ["kernel", "site"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@budget(4)
@given(
    seed=st.integers(0, 2**31 - 1),
    bad=st.lists(spots, min_size=1, max_size=12),
    rows=st.lists(whole_rows, max_size=2),
    masks=st.sampled_from((0, 5)),
    sanitize=st.booleans(),
    count_neginf=st.booleans(),
)
def test_large_batches_take_the_chunked_check_and_do_what_the_oracle_says(
    driver: str,
    dtype: torch.dtype,
    seed: int,
    bad: list[tuple[int, int, str]],
    rows: list[tuple[int, str]],
    masks: int,
    sanitize: bool,
    count_neginf: bool,
) -> None:
    x = _batch(dtype, seed, bad, rows, masks)
    assert x.numel() >= _CHUNKED_CHECK_MIN  # past the plain-sum check
    mode = Mode(sanitize=sanitize, count_neginf=count_neginf)
    expected = mode.expected(x)
    # Two calls on one set of buffers: what the first leaves must not leak into the second.
    opened = (
        open_driver("site", mode, dtypes=(dtype,))
        if driver == "site"
        else contextlib.nullcontext(KernelDriver(CPU_KERNEL, mode))
    )
    with opened as call:
        for _ in range(2):
            y = x.clone()
            outcome = call(y)
            assert torch.equal(outcome.flags, expected.flags)
            assert outcome.counts == expected.counts
            assert expected.holds_for(y)
