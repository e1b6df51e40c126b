"""The fused Triton kernel equals the torch reference, run by Triton's interpreter on CPU.

`TRITON_INTERPRET=1` must be set when a `@triton.jit` function is decorated. Rather than set
it at import (pytest imports every test module before running any, so it would hold for the
whole session and for every subprocess other tests start), a module-scoped fixture sets it
only while this module's tests run, and loads a private copy of the device-code module under
another name. `guardrails.kernels._triton_kernel`, if anything else imports it, stays a
normally compiled module; no other test can meet an interpreted kernel or the variable (which
matters on a GPU machine, where `tests/test_cuda.py` may run in the same session). The kernel
calls only Triton builtins, so this copy runs in the interpreter even though `triton` itself
was imported, by then, in compiled mode.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails.flags import LOGITS_SLOTS, RowFlag
from guardrails.kernels.base import HealSpec
from guardrails.kernels.reference import guard_logits_reference_
from guardrails.kernels.values import posinf_replacement
from tests.strategies import DTYPES, INT_VIEW, Case, logits_cases

pytest.importorskip("triton")

from guardrails.kernels import triton_impl

_DEVICE_CODE = Path(triton_impl.__file__).with_name("_triton_kernel.py")
# (block, iters): one program per row, and rows cut into programs of one or two blocks.
_CUTS = {"whole_rows": (4096, None), "split_1": (16, 1), "split_2": (16, 2)}


@pytest.fixture(scope="module")
def device_code() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("guardrails_interpreted_kernel", _DEVICE_CODE)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.fixture(scope="module")
def kernels(device_code: ModuleType) -> dict[str, triton_impl.TritonLogitsKernel]:
    return {
        name: triton_impl.build(device_code, block=block, iters=iters)
        for name, (block, iters) in _CUTS.items()
    }


def _spec(dtype: torch.dtype, sanitize: bool, count_neginf: bool, explicit: bool) -> HealSpec:
    if explicit:
        # Configured values the dtype cannot hold exactly: rounded as the reference does.
        value = 1e30 if dtype != torch.float16 else 6.0e4 + 1.0
        return HealSpec(-value, value, sanitize, count_neginf)
    return HealSpec(-math.inf, posinf_replacement(dtype, 1e-5), sanitize, count_neginf)


def _buffers(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    flags = torch.full((rows,), 255, dtype=torch.uint8)  # stale bytes must be overwritten
    return flags, torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64)


def _assert_matches_reference(
    kernel: triton_impl.TritonLogitsKernel,
    x: torch.Tensor,
    spec: HealSpec,
    ws: triton_impl.TritonWorkspace,
    description: str,
) -> None:
    rows = x.numel() // x.shape[-1]
    want = x.clone()
    want_flags, want_counts = _buffers(rows)
    guard_logits_reference_(want, want_flags, want_counts, spec)
    flags, counts = _buffers(rows)
    kernel(x, flags, counts, spec, ws)
    assert torch.equal(flags, want_flags), description
    assert torch.equal(counts, want_counts), description
    int_view = INT_VIEW[x.dtype]
    assert torch.equal(x.view(int_view), want.view(int_view)), description
    assert not ws.rowstate.any(), "every row's ticket word must be reset for the next call"


@pytest.mark.parametrize("cut", _CUTS)
@given(
    logits_cases(max_rows=4, max_vocab=100, max_abs=None),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_triton_kernel_equals_reference(
    kernels: dict[str, triton_impl.TritonLogitsKernel],
    cut: str,
    case: Case,
    sanitize: bool,
    count_neginf: bool,
    explicit: bool,
) -> None:
    x = case.tensor
    if x.numel() == 0:
        return
    kernel = kernels[cut]
    ws = kernel.workspace(x.numel() // x.shape[-1], x.device)
    _assert_matches_reference(
        kernel, x, _spec(x.dtype, sanitize, count_neginf, explicit), ws, case.description
    )


def test_triton_float64_logits_take_the_reference_path(
    kernels: dict[str, triton_impl.TritonLogitsKernel],
) -> None:
    # Beyond float32's range: classifying in float32 would call these +Inf.
    x = torch.tensor([[1e300, -1e300, math.nan, math.inf, 0.5]], dtype=torch.float64)
    kernel = kernels["split_1"]
    _assert_matches_reference(
        kernel, x, _spec(torch.float32, True, False, False), kernel.workspace(1, x.device), "f64"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sanitize", [True, False], ids=["sanitize", "detect_only"])
def test_triton_split_rows_with_no_valid_entry_are_finished_once(
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
    kernel(x.clone(), flags, counts, _spec(dtype, sanitize, True, False), ws)
    no_valid = int(RowFlag.NO_VALID_TOKEN)
    assert flags.tolist() == [
        int(RowFlag.NAN) | no_valid,
        int(RowFlag.NEGINF) | no_valid,
        int(RowFlag.NAN | RowFlag.NEGINF) | no_valid,
        int(RowFlag.NAN),
    ]
    assert counts.tolist() == [70 + 35 + 1, 0, 70 + 35, 4, 3]


@pytest.mark.parametrize("cut", ["split_1", "whole_rows"])
def test_triton_repeated_calls_on_one_workspace_stay_exact(
    kernels: dict[str, triton_impl.TritonLogitsKernel], cut: str
) -> None:
    # Replays of a captured graph reuse the scratch: each call must leave it as it found it.
    kernel = kernels[cut]
    ws = kernel.workspace(3, torch.device("cpu"))
    spec = _spec(torch.float32, True, False, False)
    generator = torch.Generator().manual_seed(0)
    for call in range(4):
        x = torch.randn(3, 50, generator=generator)
        x[call % 3, call * 7] = math.nan
        x[(call + 1) % 3, :] = -math.inf if call % 2 else math.nan
        _assert_matches_reference(kernel, x, spec, ws, f"call {call}")


def test_triton_full_vocab_row_uses_the_automatic_split(device_code: ModuleType) -> None:
    kernel = triton_impl.build(device_code)
    ws = triton_impl.TritonWorkspace(2, torch.device("cpu"), sm_count=132)  # an H200's SMs
    vocab = 151936
    plan = kernel.plan(2, vocab, torch.float32, ws)
    assert plan.splits > 1
    x = torch.randn(2, vocab)
    x[0, [0, 4095, 4096, vocab - 1]] = math.nan
    x[1, 77_777] = math.inf
    _assert_matches_reference(kernel, x, _spec(torch.float32, True, False, False), ws, "B=2")


# -- launch plans (host logic, no kernel run) ---------------------------------------------


def _plan(
    device_code: ModuleType, rows: int, vocab: int, *, iters: int | None = None
) -> triton_impl.LaunchPlan:
    kernel = triton_impl.build(device_code, iters=iters)
    ws = triton_impl.TritonWorkspace(1, torch.device("cpu"), sm_count=132)
    return kernel.plan(rows, vocab, torch.float32, ws)


def test_triton_plan_gives_a_single_row_one_program_per_block(device_code: ModuleType) -> None:
    plan = _plan(device_code, 1, 151936)
    assert (plan.block, plan.splits) == (4096, 38)  # ceil(151936 / 4096)


def test_triton_plan_keeps_large_batches_at_a_few_programs_per_row(
    device_code: ModuleType,
) -> None:
    plan = _plan(device_code, 256, 151936)
    assert 1 <= plan.splits <= 4
    assert plan.chunk * plan.splits >= 151936 > plan.chunk * (plan.splits - 1)


def test_triton_plan_shrinks_the_block_for_small_vocabularies(device_code: ModuleType) -> None:
    assert _plan(device_code, 8, 100).block == 128


def test_triton_plan_rejects_a_vocab_beyond_its_packed_counters(device_code: ModuleType) -> None:
    with pytest.raises(ValueError, match="too large"):
        _plan(device_code, 1, 4096 * 4096 * 1024, iters=1)


@pytest.mark.parametrize(("option", "value"), [("block", 48), ("iters", 0), ("iters", 1024)])
def test_triton_kernel_rejects_bad_launch_options(
    device_code: ModuleType, option: str, value: int
) -> None:
    with pytest.raises(ValueError, match=option):
        triton_impl.build(device_code, **{option: value})


def test_triton_kernel_is_none_when_triton_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "guardrails.kernels._triton_kernel", raising=False)
    triton_impl.kernel.cache_clear()
    try:
        assert triton_impl.kernel() is None
    finally:
        triton_impl.kernel.cache_clear()


def test_triton_kernel_is_built_where_triton_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Compiled mode, as on a GPU: the module fixture's variable must not reach this import.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_impl.kernel.cache_clear()
    built = triton_impl.kernel()
    assert isinstance(built, triton_impl.TritonLogitsKernel)
    assert built.name == "triton"
