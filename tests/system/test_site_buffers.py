"""A site's per-device buffers: growth that fails leaves the site intact, and CUDA graphs
captured against the buffers stay valid (growth after a capture, first use inside one,
replay-only sites reporting, side streams, another device). The CUDA tests skip without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from guardrails import RowFlag
from guardrails.testing import fresh_guardrails

SITE = "sampler.logits"
HUGE = 2**45  # 32 TiB of uint8 flags: the allocation fails at once


def test_a_failed_growth_leaves_the_site_sized_as_before() -> None:
    guards = fresh_guardrails()
    site = guards.site(SITE, device="cpu", capacity=256)
    with pytest.raises(RuntimeError, match="allocate"):
        site.reserve(HUGE, "cpu")
    clean = torch.randn(300, 8)
    flags = site(clean)
    assert flags.shape == (300,)
    assert not flags.any()


def test_a_dirty_call_after_a_failed_growth_is_healed_and_counted() -> None:
    guards = fresh_guardrails()
    site = guards.site(SITE, device="cpu", capacity=256)
    with pytest.raises(RuntimeError, match="allocate"):
        site.reserve(HUGE, "cpu")
    x = torch.randn(300, 8)
    x[299, 3] = math.nan
    flags = site(x)
    assert flags.shape == (300,)
    assert int(flags[299]) == int(RowFlag.NAN)
    assert x[299, 3] == -math.inf
    assert guards.count(SITE, "nan") == 1


needs_cuda = pytest.mark.cuda


def _triton() -> None:
    pytest.importorskip("triton")


@needs_cuda
def test_growth_after_a_capture_keeps_the_buffers_the_graph_writes() -> None:
    _triton()
    guards = fresh_guardrails(reporting={"every_calls": 1_000_000})
    site = guards.site(SITE, device="cuda", capacity=8)
    static = torch.randn(8, 4096, device="cuda")
    site(static.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flags = site(static)
    site(torch.randn(600, 4096, device="cuda"))  # grows: the captured buffers must survive
    site.reserve(5000, "cuda")
    before = guards.count(SITE, "nan")
    for i in range(20):
        static.copy_(torch.randn(8, 4096, device="cuda"))
        static[i % 8, 0] = math.nan
        graph.replay()
        torch.cuda.synchronize()
        assert flags.tolist() == [int(RowFlag.NAN) if r == i % 8 else 0 for r in range(8)]
    assert guards.count(SITE, "nan") - before == 20


@needs_cuda
def test_first_use_of_a_site_inside_a_capture_is_refused_naming_reserve() -> None:
    guards = fresh_guardrails()
    site = guards.site(SITE)
    static = torch.randn(4, 256, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"reserve"), torch.cuda.graph(graph):
        site(static)


@needs_cuda
def test_a_site_that_only_replays_reports_through_poll() -> None:
    _triton()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1_000_000})
    site = guards.site(SITE, device="cuda", capacity=4)
    static = torch.randn(4, 1024, device="cuda")
    site(static.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        site(static)
    static[0, :3] = math.nan
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    labels = {"site": SITE, "kind": "nan", "rank": "0"}
    for _ in range(3):  # the first poll asks for a copy, a later one reads it
        guards.poll()
        torch.cuda.synchronize()
    assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 15


@needs_cuda
def test_exact_counts_include_calls_on_a_side_stream() -> None:
    guards = fresh_guardrails()
    site = guards.site(SITE, device="cuda", capacity=4)
    side = torch.cuda.Stream()
    x = torch.randn(4, 1 << 16, device="cuda")
    x[1, 7] = math.nan
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(50):
            site(x)  # healed at the first call, clean after
        x2 = torch.full((4, 1 << 16), math.nan, device="cuda")
        site(x2)
    assert guards.count(SITE, "nan") == 1 + 4 * (1 << 16)


@needs_cuda
def test_a_tensor_on_another_device_is_guarded_on_its_own_device() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    _triton()
    guards = fresh_guardrails()
    site = guards.site(SITE)
    x = torch.randn(3, 2048, device="cuda:1")
    x[2, 5] = math.inf
    with torch.cuda.device(0):
        flags = site(x)
    assert flags.device == x.device
    assert flags.tolist() == [0, 0, int(RowFlag.POSINF)]
    assert math.isfinite(float(x[2, 5]))
