"""What is particular to the CPU kernel: its row sums (the site's check of small batches, its
own of large ones), chunk sums of the rows that are not finite, float16 chunk sums, -inf
masks, flags left by earlier calls, the chunk plan. The random-input contract of every
kernel is `test_logits_contract.py`; here, the shapes that reach the CPU kernel's own paths
(a real 151,936 vocabulary, most rows dirty) are held to the oracle."""

from __future__ import annotations

import math

import pytest
import torch

from guardrails.flags import LOGITS_SLOTS
from guardrails.kernels._cpu import CPU_KERNEL, CpuLogitsKernel, chunk_plan
from tests.contract.guards import KernelDriver, Mode
from tests.contract.strategies import DTYPES

# Default chunks, and tiny ones so that small tensors span many chunks and a tail.
CPU_KERNELS = {"default": CPU_KERNEL, "chunk7": CpuLogitsKernel(chunk=7)}


def _assert_as_the_oracle_says(kernel: CpuLogitsKernel, x: torch.Tensor, mode: Mode) -> None:
    expected = mode.expected(x)
    outcome = KernelDriver(kernel, mode)(x)
    assert torch.equal(outcome.flags, expected.flags)
    assert outcome.counts == expected.counts
    assert expected.holds_for(x)


def _counts(**nonzero: int) -> dict[str, int]:
    return {**dict.fromkeys((str(k) for k in LOGITS_SLOTS), 0), **nonzero}


@pytest.mark.parametrize("vocab", [1023, 1024, 1536, 151936])
def test_float16_chunk_sums_of_large_logits_do_not_raise_false_alarms(vocab: int) -> None:
    # 151936 values of magnitude ~60 overflow a plain float16 sum; the chunked check must
    # still see a clean batch as clean and find the one NaN.
    x = (torch.rand(3, vocab) * 20 + 50).to(torch.float16)
    clean = KernelDriver(CPU_KERNEL, Mode())(x)
    assert clean.flags.tolist() == [0, 0, 0]
    assert clean.counts == _counts()
    x[1, vocab // 2] = math.nan
    dirty = KernelDriver(CPU_KERNEL, Mode())(x)
    assert dirty.flags.tolist() == [0, 1, 0]
    assert dirty.counts == _counts(nan=1, rows_nonfinite=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_batches_chunk_the_rows_that_are_not_finite_as_the_oracle_says(
    dtype: torch.dtype,
) -> None:
    # 16 rows of a real vocabulary: past the size of the site's check; the kernel sums the
    # rows itself (float16: chunks), then chunk-sums the rows that are not finite, run by run.
    x = (torch.randn(16, 151936) * 4 - 3).to(dtype)
    x[3, [0, 70_000, 151935]] = math.nan
    x[9, 12_345] = math.inf
    x[12] = -math.inf
    x[14, ::7] = -math.inf
    _assert_as_the_oracle_says(CPU_KERNEL, x, Mode())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_large_batch_rows_with_a_tail_chunk_do_what_the_oracle_says(dtype: torch.dtype) -> None:
    # 131073 = 32 chunks of 4096 (128 of 1024) and a one-column tail, in 16 rows: past the
    # site's check. A bad value in a body chunk and in the tail of scattered rows, and
    # consecutive rows, map back to their rows of `x`.
    vocab = 131073
    x = (torch.randn(16, vocab, generator=torch.Generator().manual_seed(1)) * 4 - 3).to(dtype)
    x[2, vocab - 1] = math.nan
    x[7, 40_000] = math.inf
    x[7, vocab - 1] = -math.inf
    x[11] = -math.inf
    x[12, 5] = math.nan
    for mode in (Mode(), Mode(count_neginf=True)):
        _assert_as_the_oracle_says(CPU_KERNEL, x.clone(), mode)
    _assert_as_the_oracle_says(CPU_KERNEL, x[11:13].repeat(8, 1), Mode())


def test_many_scattered_dirty_rows_of_a_large_batch_do_what_the_oracle_says() -> None:
    # 20 runs of dirty rows (every other row of 40), more than are chunk-summed run by run:
    # every row is chunk-summed instead.
    x = (torch.randn(40, 65536, generator=torch.Generator().manual_seed(2)) * 4 - 3).bfloat16()
    x[::2, 7] = math.nan
    x[2::4, 60_000] = math.inf
    x[6] = -math.inf
    _assert_as_the_oracle_says(CPU_KERNEL, x, Mode(count_neginf=True))


def test_neginf_masks_in_every_chunk_leave_rows_unflagged() -> None:
    # Grammar masks put -inf everywhere; without count_neginf they are legitimate.
    x = torch.randn(3, 151936)
    x[:, ::5] = -math.inf
    x[2, 7] = math.nan
    outcome = KernelDriver(CPU_KERNEL, Mode())(x)
    assert outcome.flags.tolist() == [0, 0, 1]
    assert outcome.counts == _counts(nan=1, rows_nonfinite=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(2, 16384), (8, 151936), (2, 3, 8192)], ids=str)
def test_small_batches_checked_row_by_row_do_what_the_oracle_says(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    # Large enough for torch to share the rows between threads, under the chunked check's
    # size: one sum per row, added up on the host.
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4 - 3).to(dtype)
    _assert_as_the_oracle_says(CPU_KERNEL, x.clone(), Mode())
    # Row 0 stays clean: a check that missed any other row would miss what follows.
    rows = x.view(-1, shape[-1])
    rows[1, 5] = math.inf  # +Inf and -Inf row sums: their total is NaN
    rows[-1, 7] = -math.inf
    for mode in (Mode(), Mode(count_neginf=True)):
        _assert_as_the_oracle_says(CPU_KERNEL, x.clone(), mode)
    rows[-1, ::3] = math.nan
    _assert_as_the_oracle_says(CPU_KERNEL, x, Mode())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_sums_that_overflow_leave_a_clean_batch_clean(dtype: torch.dtype) -> None:
    # Finite values whose row sums overflow: the exact pass that follows finds nothing.
    x = torch.full((4, 16384), torch.finfo(dtype).max / 2, dtype=dtype)
    x[1] *= -1
    outcome = KernelDriver(CPU_KERNEL, Mode())(x)
    assert outcome.flags.tolist() == [0, 0, 0, 0]
    assert outcome.counts == _counts()


@pytest.mark.parametrize("kernel", CPU_KERNELS.values(), ids=CPU_KERNELS.keys())
def test_most_rows_dirty_do_what_the_oracle_says(kernel: CpuLogitsKernel) -> None:
    x = torch.randn(40, 3000)
    x[::3, 5] = math.nan
    x[1::3, 2000:] = math.inf
    x[2::6] = -math.inf
    _assert_as_the_oracle_says(kernel, x, Mode(count_neginf=True))


@pytest.mark.parametrize("kernel", CPU_KERNELS.values(), ids=CPU_KERNELS.keys())
def test_flags_left_by_a_dirty_call_are_cleared_by_later_calls(kernel: CpuLogitsKernel) -> None:
    spec = Mode().spec(torch.float32)
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


@pytest.mark.parametrize("vocab", [50, 16384], ids=["one_sum", "row_sums"])
def test_the_sites_clean_check_proves_clean_batches_and_hands_dirty_ones_on(vocab: int) -> None:
    spec = Mode().spec(torch.float32)
    ws = CPU_KERNEL.workspace(4, torch.device("cpu"))
    flags = torch.zeros(4, dtype=torch.uint8)
    counts = torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)
    assert CPU_KERNEL.check(torch.randn(4, vocab), flags, ws)
    dirty = torch.randn(4, vocab)
    dirty[1, 7] = math.nan
    assert not CPU_KERNEL.check(dirty, flags, ws)
    assert ws.checked is False  # the kernel call that follows need not sum again
    CPU_KERNEL(dirty, flags, counts, spec, ws)
    assert ws.checked is None
    assert flags.tolist() == [0, 1, 0, 0]
    assert dirty[1, 7] == -math.inf
    # A large or float16 batch is not the check's: the kernel's chunked check decides.
    assert not CPU_KERNEL.check(torch.randn(4, 50).half(), flags, ws)
    assert ws.checked is None
    # A stale "not finite" (a call that raised between check and kernel) costs time only.
    ws.checked = False
    CPU_KERNEL(torch.randn(4, 50), flags, counts, spec, ws)
    assert flags.tolist() == [0, 0, 0, 0]
    assert counts.tolist() == [1, 0, 0, 1, 0]


@pytest.mark.parametrize(
    ("vocab", "target", "plan"),
    [
        (151936, 16384, (18992, 8)),  # a divisor near the target: no tail
        (151936, 1024, (1187, 128)),
        (100, 1000, (100, 1)),  # one chunk covers a small vocabulary
        (1009, 100, (100, 10)),  # a prime: chunks of the target and a 9-column tail
    ],
)
def test_chunk_plan_prefers_divisors_near_the_target(
    vocab: int, target: int, plan: tuple[int, int]
) -> None:
    assert chunk_plan(vocab, target) == plan


@pytest.mark.parametrize("chunk", [0, 40_000])
def test_kernel_rejects_a_chunk_its_counters_cannot_hold(chunk: int) -> None:
    with pytest.raises(ValueError, match="chunk must be in"):
        CpuLogitsKernel(chunk=chunk)


@pytest.mark.parametrize("vocab", [1, 2, 7, 64])
def test_a_one_value_chunk_does_what_the_oracle_says(vocab: int) -> None:
    # chunk=1 is accepted by the constructor; its plan used to divide by zero.
    assert chunk_plan(vocab, 1) == (1, vocab)
    x = torch.randn(5, vocab)
    x[1, 0] = math.nan
    x[3, vocab - 1] = math.inf
    x[4] = -math.inf
    _assert_as_the_oracle_says(CpuLogitsKernel(chunk=1), x, Mode(count_neginf=True))
