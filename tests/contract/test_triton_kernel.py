"""What is particular to the Triton kernel, run by Triton's interpreter on the CPU (the
`triton_device_code` fixture, tests/contract/conftest.py): float64 logits, rows split across
programs, its scratch reused across calls, a full vocabulary's automatic split, launch plans,
and building it with and without Triton. The random-input contract of every kernel, this one
cut three ways included, is `test_logits_contract.py`; the compiled kernel on a GPU is
`test_cuda_kernel.py`.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType

import pytest
import torch

from guardrails.flags import LOGITS_SLOTS, RowFlag
from tests.contract.guards import Mode
from tests.contract.strategies import DTYPES

pytest.importorskip("triton")

from guardrails.kernels import triton_impl


@pytest.fixture(scope="module")
def kernels(triton_device_code: ModuleType) -> dict[str, triton_impl.TritonLogitsKernel]:
    # (block, iters): one program per row, and rows cut into programs of one or two blocks.
    cuts = {"whole_rows": (4096, None), "split_1": (16, 1), "split_2": (16, 2)}
    return {
        name: triton_impl.build(triton_device_code, block=block, iters=iters)
        for name, (block, iters) in cuts.items()
    }


def _buffers(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    flags = torch.full((rows,), 255, dtype=torch.uint8)  # stale bytes must be overwritten
    return flags, torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)


def _assert_as_the_oracle_says(
    kernel: triton_impl.TritonLogitsKernel,
    x: torch.Tensor,
    mode: Mode,
    ws: triton_impl.TritonWorkspace,
    description: str,
) -> None:
    expected = mode.expected(x)
    flags, counts = _buffers(x.numel() // x.shape[-1])
    kernel(x, flags, counts, mode.spec(x.dtype), ws)
    assert torch.equal(flags, expected.flags), description
    got = dict(zip((str(k) for k in LOGITS_SLOTS), counts.tolist(), strict=True))
    assert got == expected.counts, description
    assert expected.holds_for(x), description
    assert not ws.rowstate.any(), "every row's ticket word must be reset for the next call"


def test_float64_logits_take_the_reference_path(
    kernels: dict[str, triton_impl.TritonLogitsKernel],
) -> None:
    # Beyond float32's range: classifying in float32 would call these +Inf.
    x = torch.tensor([[1e300, -1e300, math.nan, math.inf, 0.5]], dtype=torch.float64)
    kernel = kernels["split_1"]
    _assert_as_the_oracle_says(kernel, x, Mode(), kernel.workspace(1, x.device), "f64")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sanitize", [True, False], ids=["sanitize", "detect_only"])
def test_split_rows_with_no_valid_entry_are_finished_once(
    kernels: dict[str, triton_impl.TritonLogitsKernel], dtype: torch.dtype, sanitize: bool
) -> None:
    kernel = kernels["split_1"]
    x = torch.randn(4, 70).to(dtype)
    x[0] = math.nan
    x[1] = -math.inf
    x[2, ::2] = math.nan
    x[2, 1::2] = -math.inf
    x[3, 69] = math.nan  # the row's last program holds the only bad entry
    ws = kernel.workspace(4, x.device)
    assert kernel.plan(4, 70, dtype, ws).splits == 5
    flags, counts = _buffers(4)
    kernel(x.clone(), flags, counts, Mode(sanitize, count_neginf=True).spec(dtype), ws)
    no_valid = int(RowFlag.NO_VALID_TOKEN)
    assert flags.tolist() == [
        int(RowFlag.NAN) | no_valid,
        int(RowFlag.NEGINF) | no_valid,
        int(RowFlag.NAN | RowFlag.NEGINF) | no_valid,
        int(RowFlag.NAN),
    ]
    assert counts.tolist() == [70 + 35 + 1, 0, 70 + 35, 4, 3]


@pytest.mark.parametrize("cut", ["split_1", "whole_rows"])
def test_repeated_calls_on_one_workspace_stay_exact(
    kernels: dict[str, triton_impl.TritonLogitsKernel], cut: str
) -> None:
    # Replays of a captured graph reuse the scratch: each call must leave it as it found it.
    kernel = kernels[cut]
    ws = kernel.workspace(3, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for call in range(4):
        x = torch.randn(3, 50, generator=generator)
        x[call % 3, call * 7] = math.nan
        x[(call + 1) % 3, :] = -math.inf if call % 2 else math.nan
        _assert_as_the_oracle_says(kernel, x, Mode(), ws, f"call {call}")


def test_full_vocab_row_uses_the_automatic_split(triton_device_code: ModuleType) -> None:
    kernel = triton_impl.build(triton_device_code)
    ws = triton_impl.TritonWorkspace(2, torch.device("cpu"), sm_count=132)  # an H200's SMs
    vocab = 151936
    plan = kernel.plan(2, vocab, torch.float32, ws)
    assert plan.splits > 1
    x = torch.randn(2, vocab)
    x[0, [0, 4095, 4096, vocab - 1]] = math.nan
    x[1, 77_777] = math.inf
    _assert_as_the_oracle_says(kernel, x, Mode(), ws, "B=2")


# -- launch plans (host logic, no kernel run) ---------------------------------------------


def _plan(
    triton_device_code: ModuleType, rows: int, vocab: int, *, iters: int | None = None
) -> triton_impl.LaunchPlan:
    kernel = triton_impl.build(triton_device_code, iters=iters)
    ws = triton_impl.TritonWorkspace(1, torch.device("cpu"), sm_count=132)
    return kernel.plan(rows, vocab, torch.float32, ws)


def test_plan_gives_a_single_row_one_program_per_block(
    triton_device_code: ModuleType,
) -> None:
    plan = _plan(triton_device_code, 1, 151936)
    assert (plan.block, plan.splits) == (4096, 38)  # ceil(151936 / 4096)


def test_plan_keeps_large_batches_at_a_few_programs_per_row(
    triton_device_code: ModuleType,
) -> None:
    plan = _plan(triton_device_code, 256, 151936)
    assert 1 <= plan.splits <= 4
    assert plan.chunk * plan.splits >= 151936 > plan.chunk * (plan.splits - 1)


def test_plan_shrinks_the_block_for_small_vocabularies(
    triton_device_code: ModuleType,
) -> None:
    assert _plan(triton_device_code, 8, 100).block == 128


def test_plan_rejects_a_vocab_beyond_its_packed_counters(
    triton_device_code: ModuleType,
) -> None:
    with pytest.raises(ValueError, match="too large"):
        _plan(triton_device_code, 1, 4096 * 4096 * 1024, iters=1)


@pytest.mark.parametrize(("option", "value"), [("block", 48), ("iters", 0), ("iters", 1024)])
def test_kernel_rejects_bad_launch_options(
    triton_device_code: ModuleType, option: str, value: int
) -> None:
    with pytest.raises(ValueError, match=option):
        triton_impl.build(triton_device_code, **{option: value})


def test_kernel_is_none_when_triton_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "guardrails.kernels._triton_kernel", raising=False)
    triton_impl.kernel.cache_clear()
    try:
        assert triton_impl.kernel() is None
    finally:
        triton_impl.kernel.cache_clear()


def test_kernel_is_built_where_triton_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Compiled mode, as on a GPU: the interpreter's variable must not reach this import.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_impl.kernel.cache_clear()
    built = triton_impl.kernel()
    assert isinstance(built, triton_impl.TritonLogitsKernel)
    assert built.name == "triton"


@pytest.mark.parametrize("cut", ["whole_rows", "split_1", "split_2"])
@pytest.mark.parametrize("view", ["rows_share_memory", "one_value_per_row", "one_value"])
def test_detect_only_reads_memory_that_overlaps_itself_as_the_oracle_says(
    kernels: dict[str, triton_impl.TritonLogitsKernel], cut: str, view: str
) -> None:
    # Healing refuses such views before any kernel runs (a shared value cannot be healed
    # consistently); detect-only sites read them, on the GPU through this kernel: every
    # logical entry is counted as what it holds.
    row = torch.tensor([0.5, math.nan, math.inf, -math.inf, 2.0] * 8)
    if view == "rows_share_memory":
        x = row.expand(3, -1)  # row stride 0
    elif view == "one_value_per_row":
        x = torch.tensor([[math.nan], [1.0], [math.inf]]).expand(-1, 40)  # vocab stride 0
    else:
        x = torch.tensor(math.nan).expand(2, 40)  # both strides 0
    kernel = kernels[cut]
    mode = Mode(False, count_neginf=True)
    _assert_as_the_oracle_says(kernel, x, mode, kernel.workspace(3, x.device), view)


def test_a_variant_first_met_inside_a_capture_is_guarded_by_the_reference(
    triton_device_code: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compiling and loading a Triton binary inside a CUDA-graph capture is not safe: until a
    # variant has been launched once outside a capture, captured calls take the reference.
    # ("Capturing" is simulated for the interpreter's CPU tensors.)
    capturing = [True]
    kernel = triton_impl.build(
        triton_device_code, block=16, iters=1, capturing=lambda x: capturing[0]
    )
    reference_calls: list[tuple[int, ...]] = []
    real_reference = triton_impl.guard_logits_reference_

    def spy(x: torch.Tensor, *args: object) -> None:
        reference_calls.append(tuple(x.shape))
        real_reference(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_impl, "guard_logits_reference_", spy)
    ws = kernel.workspace(16, torch.device("cpu"))
    mode = Mode()

    def call(x: torch.Tensor) -> None:
        _assert_as_the_oracle_says(kernel, x, mode, ws, f"{tuple(x.shape)} {x.dtype}")

    dirty = torch.randn(4, 70)
    dirty[1, 3] = math.nan
    call(dirty.clone())  # captured, never launched: the reference, and still exact
    assert reference_calls == [(4, 70)]
    capturing[0] = False
    call(dirty.clone())  # eager: launched (compiled) now
    capturing[0] = True
    call(dirty.clone())  # the same variant, captured: the kernel
    call(torch.randn(9, 70))  # another batch size, the same variant: the kernel
    assert reference_calls == [(4, 70)]
    call(torch.randn(4, 70).to(torch.bfloat16))  # another dtype: not launched yet
    call(torch.randn(4, 70)[:, 1:])  # another alignment and vocab: not launched yet
    assert reference_calls == [(4, 70), (4, 70), (4, 69)]
