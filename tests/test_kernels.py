"""Every fast kernel agrees with the torch reference, bit for bit, on flags and counts too."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails.flags import LOGITS_SLOTS
from guardrails.kernels import HealSpec, posinf_replacement
from guardrails.kernels.cpu import CPU_KERNEL, _all_finite
from guardrails.kernels.reference import REFERENCE_KERNEL
from tests.strategies import INT_VIEW, Case, logits_cases


def _run(kernel: object, x: torch.Tensor, spec: HealSpec) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    flags = torch.full((rows,), 255, dtype=torch.uint8)  # stale bytes must be overwritten
    counts = torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)
    ws = kernel.workspace(rows, x.device)  # type: ignore[attr-defined]
    if ws is not None:
        ws.extent = rows
    kernel(x, flags, counts, spec, ws)  # type: ignore[operator]
    return flags, counts


@given(
    logits_cases(min_vocab=1, max_vocab=3000, max_rows=4, max_abs=None),
    st.booleans(),
    st.booleans(),
)
def test_cpu_kernel_equals_reference(case: Case, sanitize: bool, count_neginf: bool) -> None:
    x = case.tensor
    if x.numel() == 0:
        return
    spec = HealSpec(-math.inf, posinf_replacement(x.dtype, 1e-5), sanitize, count_neginf)
    y = x.clone()
    got_flags, got_counts = _run(CPU_KERNEL, x, spec)
    want_flags, want_counts = _run(REFERENCE_KERNEL, y, spec)
    assert torch.equal(got_flags, want_flags), case.description
    assert torch.equal(got_counts, want_counts), case.description
    assert torch.equal(x.view(INT_VIEW[x.dtype]), y.view(INT_VIEW[y.dtype])), case.description


@pytest.mark.parametrize("vocab", [1023, 1024, 1536, 151936])
def test_cpu_float16_clean_check_survives_sums_that_overflow_float16(vocab: int) -> None:
    # 151936 values of magnitude ~60 overflow a plain float16 sum; the chunked check must
    # still see a clean batch as clean (a false alarm would send it down the slow path).
    x = (torch.rand(3, vocab) * 20 + 50).to(torch.float16)
    assert _all_finite(x)
    x[1, vocab // 2] = math.nan
    assert not _all_finite(x)
    spec = HealSpec(-math.inf, posinf_replacement(torch.float16, 1e-5), True, False)
    flags, counts = _run(CPU_KERNEL, x, spec)
    assert flags.tolist() == [0, 1, 0]
    assert counts.tolist() == [1, 0, 0, 1, 0]
