"""A site's per-device buffers: growth that fails leaves the site intact, per-stream buffers on
CUDA (their bookkeeping simulated on the CPU, then two real streams), and CUDA graphs captured
against the buffers stay valid (growth after a capture, first use inside one, replay-only
sites reporting, side streams, another device). The CUDA tests skip without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from guardrails import RowFlag
from guardrails.sites import _buffers, _site
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


class _Streams:
    """A CPU site's state made to key its buffers by (thread, stream) as CUDA states do, with
    the current stream and "is capturing" set by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, site: _site.LogitsSite) -> None:
        self.stream = 1
        self.capturing = False
        state = site._state
        assert state is not None
        state.streams = True
        self.state = state
        monkeypatch.setattr(_buffers, "cuda_stream_id", lambda index: self.stream)
        monkeypatch.setattr(_buffers, "capturing_on", lambda device: self.capturing)


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> tuple[_site.LogitsSite, _Streams]:
    site = fresh_guardrails().site(SITE, device="cpu", capacity=8)
    assert isinstance(site, _site.LogitsSite)
    return site, _Streams(monkeypatch, site)


def test_each_stream_of_a_thread_gets_its_own_flags_and_kernel_workspace(
    streamed: tuple[_site.LogitsSite, _Streams],
) -> None:
    site, streams = streamed
    dirty = torch.randn(4, 32)
    dirty[2, 5] = math.nan
    flags_1 = site(dirty)
    streams.stream = 2
    flags_2 = site(torch.randn(4, 32))
    assert flags_1.data_ptr() != flags_2.data_ptr()
    # Stream 2's clean call left stream 1's flags alone (they are that stream's output).
    assert flags_1.tolist() == [0, 0, int(RowFlag.NAN), 0]
    assert flags_2.tolist() == [0, 0, 0, 0]
    state = streams.state
    workspaces = {id(b.workspace) for b in state.buffers.values()}
    assert len(state.buffers) == len(workspaces) == 2
    # recent() is the thread's latest call on any stream (a hook may read it outside the
    # stream context its sampler ran in).
    for stream in (1, 2, 7):
        streams.stream = stream
        found = site.recent()
        assert found is not None
        assert found[0] == site.calls
        assert found[1].data_ptr() == flags_2.data_ptr()
    streams.stream = 1
    site(dirty)
    streams.stream = 2
    found = site.recent()
    assert found is not None
    assert found[1].data_ptr() == flags_1.data_ptr()


def test_a_capture_on_a_new_stream_takes_the_spare_the_eager_calls_keep_ready(
    streamed: tuple[_site.LogitsSite, _Streams],
) -> None:
    site, streams = streamed
    eager = site(torch.randn(4, 32))  # takes the spare made with the state, makes another
    state = streams.state
    assert len(state.spare) == 1
    # torch.cuda.graph captures on a side stream: nothing may be allocated there, and it gets
    # buffers of its own, never those of stream 1 (its replays would race stream 1's calls
    # on the Triton kernel's per-row words).
    streams.stream, streams.capturing = 2, True
    captured = site(torch.randn(4, 32))
    assert captured.data_ptr() != eager.data_ptr()
    assert len(state.buffers) == 2
    assert not state.spare  # not replaced inside the capture
    # A second capture on a new stream before any eager call: refused, naming reserve().
    streams.stream = 3
    with pytest.raises(RuntimeError, match=r"no spare buffers are left.*site\.reserve"):
        site(torch.randn(4, 32))
    # The next eager call (back on stream 1) makes a spare again, outside any capture.
    streams.stream, streams.capturing = 1, False
    site(torch.randn(4, 32))
    assert len(state.spare) == 1
    streams.stream, streams.capturing = 3, True
    own = site(torch.randn(4, 32))
    assert own.data_ptr() not in (eager.data_ptr(), captured.data_ptr())
    # Growth inside a capture is refused, as on one stream.
    with pytest.raises(RuntimeError, match="reserve"):
        site(torch.randn(9, 32))


def test_buffers_of_an_ended_thread_become_spares_once(
    streamed: tuple[_site.LogitsSite, _Streams],
) -> None:
    import threading

    site, streams = streamed
    site(torch.randn(2, 16))

    def worker() -> None:
        streams.stream, streams.capturing = 5, False
        site(torch.randn(2, 16))
        streams.stream, streams.capturing = 6, True
        site(torch.randn(2, 16))  # a capture: takes the spare stream 5's call left ready
        streams.stream, streams.capturing = 1, False

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    state = streams.state
    assert len(state.buffers) == 3  # main, and the worker's two streams
    distinct = {id(b) for b in state.buffers.values()}
    assert len(distinct) == 3  # no two keys share buffers
    state._reclaim()
    assert len(state.buffers) == 1
    assert len(state.spare) == 2, "the worker's two sets of buffers, each once"


def test_recent_is_the_calling_threads_latest_call_on_any_device() -> None:
    site = fresh_guardrails().site(SITE)
    assert isinstance(site, _site.LogitsSite)
    dirty = torch.randn(2, 8)
    dirty[1, 0] = math.nan
    site(dirty)
    # Another thread used another device last (two workers, one GPU each): a state of its
    # own becomes the site's most recent one. This thread's latest call is still found.
    other = _buffers.DeviceState(torch.device("cpu", 1), 2, len(site.slots), None)
    site._states[torch.device("cpu", 1)] = other
    site._state = other
    found = site.recent()
    assert found is not None
    assert found[0] == 1
    assert found[1].tolist() == [0, int(RowFlag.NAN)]


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


@needs_cuda
def test_two_streams_of_one_thread_guard_at_once_without_mixing_row_words() -> None:
    _triton()
    from guardrails.kernels import triton_impl

    kernel = triton_impl.build(block=1024, iters=1)  # every row split across programs
    guards = fresh_guardrails(reporting={"every_calls": 1_000_000})
    site = guards.site(SITE, device="cuda", capacity=64)
    state = site._state
    assert state is not None
    site._kernels[state.device] = state.kernel = kernel
    site.reserve(64, "cuda")  # a fresh workspace for the Triton kernel
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = []
    for s in range(2):
        x = torch.randn(64, 1 << 15, device="cuda")
        x[s::4, 7] = math.nan
        inputs.append(x)
    torch.cuda.synchronize()
    results: list[list[torch.Tensor]] = [[], []]
    for _ in range(50):
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                y = inputs[s].clone()
                results[s].append(site(y).clone())
    torch.cuda.synchronize()
    for s in range(2):
        expected = [int(RowFlag.NAN) if r % 4 == s else 0 for r in range(64)]
        assert all(flags.tolist() == expected for flags in results[s])
    assert guards.count(SITE, "nan") == 2 * 50 * 16
    words = [b.workspace.rowstate for b in state.buffers.values()]
    assert len({w.data_ptr() for w in words}) >= 2
    assert not any(w.any() for w in words), "a row word left non-zero never finishes again"


@needs_cuda
def test_a_capture_at_a_batch_size_never_run_eagerly_replays_exactly() -> None:
    # Warmed at one row (split rows); captured at 600 rows, which a 151936 vocabulary runs as
    # whole rows on an H100/H200: a Triton variant not compiled yet, never compiled inside
    # the capture (the reference guards that graph instead).
    _triton()
    guards = fresh_guardrails(reporting={"every_calls": 1_000_000})
    site = guards.site(SITE, device="cuda", capacity=600)
    site(torch.randn(1, 151936, device="cuda"))
    static = torch.randn(600, 151936, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flags = site(static)
    for i in range(3):
        static.copy_(torch.randn(600, 151936, device="cuda"))
        static[100 * i, 5] = math.nan
        static[100 * i + 1] = math.nan
        graph.replay()
        torch.cuda.synchronize()
        expected = [0] * 600
        expected[100 * i] = int(RowFlag.NAN)
        expected[100 * i + 1] = int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)
        assert flags.tolist() == expected
        assert static[100 * i, 5] == -math.inf
        assert not static[100 * i + 1].any()
    assert guards.count(SITE, "nan") == 3 * (1 + 151936)
