"""A whole guarded call on a real GPU (marker `cuda`), end to end.

Skipped without CUDA. Checked here: a guarded call issues exactly one kernel and no host
sync; a captured call replays exactly in a CUDA graph; async-assert mode fails the process
on the device. The compiled kernel's values, flags and counts are held to the oracle in
`tests/contract/test_cuda_kernel.py`; reporting on CUDA is `tests/reporting/test_reporting_cuda.py`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from guardrails.flags import LOGITS_SLOTS, CountKind, RowFlag
from guardrails.testing import fresh_guardrails
from tests.contract.strategies import dirty_logits

pytestmark = pytest.mark.cuda

SITE = "sampler.logits"
VOCAB = 151936
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROOT = Path(__file__).resolve().parents[2]


def _triton() -> object:
    pytest.importorskip("triton")
    from guardrails.kernels import triton_impl

    return triton_impl


def test_cuda_guarded_calls_never_sync_the_host() -> None:
    _triton()
    guards = fresh_guardrails(reporting={"every_calls": 2})
    site = guards.site(SITE, device="cuda", capacity=8)
    template = dirty_logits(8, VOCAB, torch.bfloat16)
    work = torch.empty_like(template)
    site(torch.zeros(8, VOCAB, device="cuda", dtype=torch.bfloat16))  # compile/load first
    torch.cuda.synchronize()
    [device_counts] = site.device_counts()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):  # every second call starts a copy to the host mirror
            work.copy_(template)  # fresh bad values: each call heals
            site(work)
            device_counts.latest()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guards.count(SITE, CountKind.NAN) == 12 * (3 + VOCAB + VOCAB // 2 + 1)
    assert guards.count(SITE, CountKind.ROWS_NO_VALID_TOKEN) == 12 * 3
    guards.close()


def test_cuda_first_calls_of_new_sites_and_dirty_growth_never_sync_the_host() -> None:
    _triton()
    guards = fresh_guardrails(reporting={"every_calls": 1})
    warm = guards.site("warm.logits")
    template = dirty_logits(8, VOCAB, torch.bfloat16)
    warm(template.clone())  # the Triton variant is compiled/loaded here, outside the check
    torch.cuda.synchronize()
    fresh = [guards.site(f"fresh{i}.logits") for i in range(3)]  # no device, no buffers yet
    work = torch.empty_like(template)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for site in fresh:
            work.copy_(template)
            site(work)  # first use on this device: buffers made, counted, a tick reported
        guards.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i in range(3):
        assert guards.count(f"fresh{i}.logits", CountKind.ROWS_NO_VALID_TOKEN) == 3
    guards.close()


def test_cuda_one_guarded_call_launches_exactly_one_kernel() -> None:
    _triton()
    from torch.profiler import ProfilerActivity, profile

    guards = fresh_guardrails(reporting={"every_calls": 1})  # a host copy on every call too
    site = guards.site(SITE, device="cuda", capacity=64)
    logits = [dirty_logits(64, VOCAB, dtype) for dtype in DTYPES]
    for x in logits:
        site(x.clone())  # compile/load outside the profile
    torch.cuda.synchronize()
    calls = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for x in logits:
                site(x)
        torch.cuda.synchronize()
    kernels = [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(("Memcpy", "Memset"))
    ]
    assert len(kernels) == calls * len(logits), kernels
    assert all("guard_logits_kernel" in name for name in kernels), set(kernels)
    guards.close()


@pytest.mark.parametrize("every_calls", [1, 1_000_000])
def test_cuda_graph_replays_count_fresh_bad_values_exactly(every_calls: int) -> None:
    _triton()
    # every_calls=1: a report tick falls due during the capture and must be skipped there
    # (recording a copy or querying an event would break the capture).
    guards = fresh_guardrails(reporting={"every_calls": every_calls})
    site = guards.site(SITE, device="cuda", capacity=16)
    static = torch.randn(16, VOCAB, device="cuda")
    site(static.clone())  # compile/load before capture
    torch.cuda.synchronize()
    before = {kind: guards.count(SITE, kind) for kind in LOGITS_SLOTS}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flags = site(static)
    clean = torch.randn(16, VOCAB, device="cuda")
    expected = dict.fromkeys(LOGITS_SLOTS, 0)
    replays = 100
    for i in range(replays):
        static.copy_(clean)
        nan_row, inf_row = i % 16, (i + 5) % 16
        static[nan_row, : i + 1] = math.nan
        static[inf_row, VOCAB - 2 :] = math.inf
        if i % 10 == 0:
            static[(i + 9) % 16] = -math.inf  # a row with no valid entry
            expected[CountKind.ROWS_NO_VALID_TOKEN] += 1
        expected[CountKind.NAN] += i + 1
        expected[CountKind.POSINF] += 2
        expected[CountKind.ROWS_NONFINITE] += 2
        graph.replay()
        assert static[nan_row, 0].item() == -math.inf
    torch.cuda.synchronize()
    after = {kind: guards.count(SITE, kind) - before[kind] for kind in LOGITS_SLOTS}
    assert after == expected
    last = [0] * 16  # the flags of the 100th replay (i = 99)
    last[99 % 16] = int(RowFlag.NAN)
    last[(99 + 5) % 16] = int(RowFlag.POSINF)
    assert flags.tolist() == last
    guards.close()


_ASSERT_SCRIPT = textwrap.dedent(
    """
    import math, sys, torch
    from guardrails.testing import fresh_guardrails
    guards = fresh_guardrails(async_assert=True)
    x = torch.randn(4, 1000, device="cuda")
    if sys.argv[1] == "dirty":
        x[2, 7] = math.nan
    guards.site("sampler.logits")(x)
    torch.cuda.synchronize()
    print("survived")
    """
)


@pytest.mark.parametrize("kind", ["clean", "dirty"])
def test_cuda_async_assert_fails_the_process_only_on_bad_logits(kind: str) -> None:
    # A device-side assert poisons the CUDA context, so it runs in a child process.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env = {k: v for k, v in env.items() if not k.startswith("GUARDRAILS_")}
    result = subprocess.run(
        [sys.executable, "-c", _ASSERT_SCRIPT, kind],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if kind == "clean":
        assert result.returncode == 0, result.stderr
        assert "survived" in result.stdout
    else:
        assert result.returncode != 0
        assert "survived" not in result.stdout
        assert "device-side assert" in result.stderr or "Assertion" in result.stderr, result.stderr
