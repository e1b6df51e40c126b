"""Every fast kernel agrees with the torch reference, bit for bit, on flags and counts too."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails.flags import LOGITS_SLOTS
from guardrails.kernels.base import HealSpec
from guardrails.kernels.cpu import CPU_KERNEL, CpuLogitsKernel, chunk_plan
from guardrails.kernels.reference import REFERENCE_KERNEL
from guardrails.kernels.values import posinf_replacement
from tests.strategies import INT_VIEW, Case, logits_cases

# Default chunks, and tiny ones so that small tensors span many chunks and a tail.
CPU_KERNELS = {"default": CPU_KERNEL, "chunk7": CpuLogitsKernel(chunk=7)}


def _run(
    kernel: object, x: torch.Tensor, spec: HealSpec, ws: object = None
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    flags = torch.full((rows,), 255, dtype=torch.uint8)  # stale bytes must be overwritten
    counts = torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)
    if ws is None:
        ws = kernel.workspace(rows, x.device)  # type: ignore[attr-defined]
        if ws is not None:
            ws.extent = rows  # type: ignore[attr-defined]
    kernel(x, flags, counts, spec, ws)  # type: ignore[operator]
    return flags, counts


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(INT_VIEW[x.dtype])


def _spec(dtype: torch.dtype, sanitize: bool, count_neginf: bool, explicit: bool) -> HealSpec:
    if explicit:
        # Configured values (the seed's 1e30 where the dtype holds it), not exactly
        # representable: every kernel must round them as the reference does.
        value = 1e30 if dtype != torch.float16 else 6.0e4 + 1.0
        return HealSpec(-value, value, sanitize, count_neginf)
    return HealSpec(-math.inf, posinf_replacement(dtype, 1e-5), sanitize, count_neginf)


@pytest.mark.parametrize("kernel", CPU_KERNELS.values(), ids=CPU_KERNELS.keys())
@given(
    logits_cases(min_vocab=1, max_vocab=3000, max_rows=4, max_abs=None),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_cpu_kernel_equals_reference(
    kernel: CpuLogitsKernel, case: Case, sanitize: bool, count_neginf: bool, explicit: bool
) -> None:
    x = case.tensor
    if x.numel() == 0:
        return
    spec = _spec(x.dtype, sanitize, count_neginf, explicit)
    y = x.clone()
    got_flags, got_counts = _run(kernel, x, spec)
    want_flags, want_counts = _run(REFERENCE_KERNEL, y, spec)
    assert torch.equal(got_flags, want_flags), case.description
    assert torch.equal(got_counts, want_counts), case.description
    assert torch.equal(_bits(x), _bits(y)), case.description


@pytest.mark.parametrize("vocab", [1023, 1024, 1536, 151936])
def test_cpu_float16_chunk_sums_of_large_logits_do_not_raise_false_alarms(vocab: int) -> None:
    # 151936 values of magnitude ~60 overflow a plain float16 sum; the chunked check must
    # still see a clean batch as clean and find the one NaN.
    x = (torch.rand(3, vocab) * 20 + 50).to(torch.float16)
    spec = _spec(torch.float16, True, False, False)
    clean_flags, clean_counts = _run(CPU_KERNEL, x, spec)
    assert clean_flags.tolist() == [0, 0, 0]
    assert clean_counts.tolist() == [0, 0, 0, 0, 0]
    x[1, vocab // 2] = math.nan
    flags, counts = _run(CPU_KERNEL, x, spec)
    assert flags.tolist() == [0, 1, 0]
    assert counts.tolist() == [1, 0, 0, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_large_batches_use_the_chunked_check_and_equal_reference(dtype: torch.dtype) -> None:
    # 16 rows of a real vocabulary: past the size where the clean check is one plain sum.
    x = (torch.randn(16, 151936) * 4 - 3).to(dtype)
    x[3, [0, 70_000, 151935]] = math.nan
    x[9, 12_345] = math.inf
    x[12] = -math.inf
    x[14, ::7] = -math.inf
    y = x.clone()
    spec = _spec(dtype, True, False, False)
    got_flags, got_counts = _run(CPU_KERNEL, x, spec)
    want_flags, want_counts = _run(REFERENCE_KERNEL, y, spec)
    assert torch.equal(got_flags, want_flags)
    assert torch.equal(got_counts, want_counts)
    assert torch.equal(_bits(x), _bits(y))


def test_cpu_neginf_masks_in_every_chunk_leave_rows_unflagged() -> None:
    # Grammar masks put -inf everywhere; without count_neginf they are legitimate.
    x = torch.randn(3, 151936)
    x[:, ::5] = -math.inf
    x[2, 7] = math.nan
    spec = _spec(torch.float32, True, False, False)
    flags, counts = _run(CPU_KERNEL, x, spec)
    assert flags.tolist() == [0, 0, 1]
    assert counts.tolist() == [1, 0, 0, 1, 0]


@pytest.mark.parametrize("kernel", CPU_KERNELS.values(), ids=CPU_KERNELS.keys())
def test_cpu_kernel_equals_reference_when_most_rows_are_dirty(kernel: CpuLogitsKernel) -> None:
    x = torch.randn(40, 3000)
    x[::3, 5] = math.nan
    x[1::3, 2000:] = math.inf
    x[2::6] = -math.inf
    y = x.clone()
    spec = _spec(torch.float32, True, True, False)
    got_flags, got_counts = _run(kernel, x, spec)
    want_flags, want_counts = _run(REFERENCE_KERNEL, y, spec)
    assert torch.equal(got_flags, want_flags)
    assert torch.equal(got_counts, want_counts)
    assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("kernel", CPU_KERNELS.values(), ids=CPU_KERNELS.keys())
def test_cpu_flags_left_by_a_dirty_call_are_cleared_by_later_calls(
    kernel: CpuLogitsKernel,
) -> None:
    spec = _spec(torch.float32, True, False, False)
    ws = kernel.workspace(4, torch.device("cpu"))
    buffer = torch.zeros(4, dtype=torch.uint8)
    counts = torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)
    dirty = torch.randn(4, 50)
    dirty[3, 1] = math.inf
    kernel(dirty, buffer, counts, spec, ws)
    assert buffer.tolist() == [0, 0, 0, 2]
    # A shorter clean view, then a longer one: each must read all zeros.
    kernel(torch.randn(2, 50), buffer[:2], counts, spec, ws)
    assert buffer[:2].tolist() == [0, 0]
    kernel(torch.randn(4, 50), buffer, counts, spec, ws)
    assert buffer.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("vocab", "target", "plan"),
    [
        (151936, 16384, (18992, 8)),  # a divisor near the target: no tail
        (151936, 1024, (1187, 128)),
        (100, 1000, (100, 1)),  # one chunk covers a small vocabulary
        (1009, 100, (100, 10)),  # a prime: chunks of the target and a 9-column tail
    ],
)
def test_cpu_chunk_plan_prefers_divisors_near_the_target(
    vocab: int, target: int, plan: tuple[int, int]
) -> None:
    assert chunk_plan(vocab, target) == plan


@pytest.mark.parametrize("chunk", [0, 40_000])
def test_cpu_kernel_rejects_a_chunk_its_counters_cannot_hold(chunk: int) -> None:
    with pytest.raises(ValueError, match="chunk must be in"):
        CpuLogitsKernel(chunk=chunk)
