"""The compiled Triton kernel on a real GPU, held to the oracle (marker `cuda`).

Skipped without CUDA. Every dtype, batches of 8 and 64 rows of a real 151,936 vocabulary with
every kind of bad row, the automatic cut and whole rows, every site mode, strided views; each
case twice on one workspace (the second call proves the first reset the scratch). And the
sites on a GPU use this compiled kernel, not an interpreted copy.
"""

from __future__ import annotations

import os

import pytest
import torch

from guardrails.flags import LOGITS_SLOTS
from guardrails.testing import fresh_guardrails
from tests.contract.guards import Mode
from tests.contract.strategies import dirty_logits

pytestmark = pytest.mark.cuda

VOCAB = 151936
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton() -> object:
    pytest.importorskip("triton")
    from guardrails.kernels import triton_impl

    return triton_impl


def _assert_as_the_oracle_says(kernel: object, x: torch.Tensor, mode: Mode) -> None:
    rows = x.shape[0]
    expected = mode.expected(x)
    flags = torch.full((rows,), 255, dtype=torch.uint8, device="cuda")
    counts = torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64, device="cuda")
    ws = kernel.workspace(rows, x.device)  # type: ignore[attr-defined]
    for _ in range(2):  # the second call proves the scratch was reset by the first
        # A copy with x's own strides (clone() would make a strided view contiguous).
        y = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        y.copy_(x)
        assert y.stride() == x.stride()
        counts.zero_()
        kernel(y, flags, counts, mode.spec(x.dtype), ws)  # type: ignore[operator]
        assert torch.equal(flags.cpu(), expected.flags)
        got = dict(zip((str(k) for k in LOGITS_SLOTS), counts.tolist(), strict=True))
        assert got == expected.counts
        assert expected.holds_for(y)
        assert not ws.rowstate.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("cut", ["auto", "whole_rows"])
def test_cuda_triton_kernel_does_what_the_oracle_says(
    dtype: torch.dtype, rows: int, cut: str
) -> None:
    triton_impl = _triton()
    kernel = triton_impl.build(iters=None if cut == "auto" else 1023)  # type: ignore[attr-defined]
    _assert_as_the_oracle_says(kernel, dirty_logits(rows, VOCAB, dtype), Mode())


@pytest.mark.parametrize(
    ("sanitize", "count_neginf", "explicit"),
    [(False, False, False), (True, True, False), (False, True, False), (True, False, True)],
)
def test_cuda_triton_kernel_does_what_the_oracle_says_in_every_site_mode(
    sanitize: bool, count_neginf: bool, explicit: bool
) -> None:
    triton_impl = _triton()
    kernel = triton_impl.build()  # type: ignore[attr-defined]
    values = {"nan_value": -1e30, "posinf_value": 1e30} if explicit else {}
    mode = Mode(sanitize=sanitize, count_neginf=count_neginf, **values)  # type: ignore[arg-type]
    _assert_as_the_oracle_says(kernel, dirty_logits(8, VOCAB, torch.float32), mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_triton_kernel_does_what_the_oracle_says_on_strided_views(dtype: torch.dtype) -> None:
    triton_impl = _triton()
    x = dirty_logits(6, 5000, dtype, strided=True)
    _assert_as_the_oracle_says(triton_impl.build(), x, Mode(count_neginf=True))  # type: ignore[attr-defined]


def test_cuda_sites_use_the_compiled_triton_kernel() -> None:
    triton_impl = _triton()
    assert "TRITON_INTERPRET" not in os.environ
    guards = fresh_guardrails()
    site = guards.site("sampler.logits", device="cuda", capacity=8)
    kernel = site._kernel(torch.device("cuda", torch.cuda.current_device()))
    assert isinstance(kernel, triton_impl.TritonLogitsKernel)  # type: ignore[attr-defined]
    assert type(kernel._jit).__name__ == "JITFunction"  # not an interpreted copy
    guards.close()
