"""The timing harness of `guardrails bench`: the methods side by side, the timers, the
host-overhead and copy-bandwidth probes. See `guardrails.cli.bench.measure` for what is timed."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any, Final

import torch

from guardrails.cli.bench.machine import probe
from guardrails.cli.bench.results import BenchConfig, BenchResult, CaseResult, HostOverhead
from guardrails.flags import LOGITS_SLOTS, CountKind
from guardrails.kernels.select import select_logits_kernel

__all__ = ["run"]

_SGLANG_NAN, _SGLANG_POSINF, _SGLANG_NEGINF = -1e30, 1e30, -1e30
_FLUSH_BYTES: Final = 256 * 2**20  # larger than any GPU's L2 cache today
_MAX_ROUNDS_PER_REPEAT: Final = 50  # `min_seconds` adds rounds up to 50 x repeats
_ORDER_SEED: Final = 20261204  # the CPU timer's order of methods per round: the same every run
# The methods that write what they heal.
_HEALING: Final = ("guard", "kernel", "sglang", "nan_to_num")

_Calls = dict[str, Callable[[], object]]
_Prepare = dict[str, Callable[[], None] | None]


def run(config: BenchConfig, progress: Callable[[CaseResult], None] | None = None) -> BenchResult:
    """Measure everything `config` asks for."""
    from guardrails.testing import SilentLogger, fresh_guardrails

    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    # The guard's log events would flood the benchmark's output; counting is unaffected.
    guards = fresh_guardrails(logger=SilentLogger())
    site = guards.site("bench.logits", device=device, capacity=max(config.batches))
    timer = _CudaTimer(device) if device.type == "cuda" else _CpuTimer()
    cases: list[CaseResult] = []
    try:
        bandwidth = _copy_bandwidth(device) if device.type == "cuda" else None
        for dtype_name in config.dtypes:
            dtype = getattr(torch, dtype_name)
            for batch in config.batches:
                for state in ("clean", "dirty"):
                    case = _measure_case(config, site, timer, batch, dtype, state, bandwidth)
                    cases.append(case)
                    if progress is not None:
                        progress(case)
        host = _host_overhead(config, site, device)
    finally:
        guards.close()
    return BenchResult(
        machine=probe(device),
        config=config,
        kernel=select_logits_kernel(device).name,
        timing=timer.method,
        host_overhead=host,
        cases=tuple(cases),
        d2d_copy_bandwidth_gbs=None if bandwidth is None else bandwidth / 1e9,
    )


def _measure_case(
    config: BenchConfig,
    site: Any,
    timer: _CpuTimer | _CudaTimer,
    batch: int,
    dtype: torch.dtype,
    state: str,
    bandwidth: float | None,
) -> CaseResult:
    device = torch.device(config.device)
    generator = torch.Generator().manual_seed(batch * 7919 + config.vocab)
    # Logits-like values: mostly negative, a few large; never overflowing float16 chunk sums.
    x = (torch.randn(batch, config.vocab, generator=generator) * 4 - 3).to(dtype).to(device)
    dirty_rows = math.ceil(config.dirty_fraction * batch) if state == "dirty" else 0
    inject = _injector(x, dirty_rows, config.bad_per_row, generator)
    counter = torch.zeros((), dtype=torch.int64, device=device)
    mirror = torch.zeros((), dtype=torch.int64, pin_memory=device.type == "cuda")
    # The site's kernel called directly, with buffers of its own: guard - kernel is what the
    # site's layer costs (dtype and layout checks, lock, buffers, call counter, reporting).
    kernel = select_logits_kernel(device)
    spec = site.spec(dtype)
    kernel_args = (
        torch.zeros(batch, dtype=torch.uint8, device=device),
        torch.zeros(len(LOGITS_SLOTS), dtype=torch.int64, device=device),
        spec,
        kernel.workspace(batch, device),
    )

    def sglang() -> None:
        counter.add_(torch.isnan(x).any())
        mirror.copy_(counter, non_blocking=True)
        x.nan_to_num_(nan=_SGLANG_NAN, posinf=_SGLANG_POSINF, neginf=_SGLANG_NEGINF)

    calls: _Calls = {
        "guard": lambda: site(x),
        "kernel": lambda: kernel(x, *kernel_args),
        "sglang": sglang,
        "nan_to_num": lambda: x.nan_to_num_(
            nan=_SGLANG_NAN, posinf=_SGLANG_POSINF, neginf=_SGLANG_NEGINF
        ),
        "amax": lambda: x.amax(-1),
        "sum": lambda: x.sum(-1),
    }
    # Read-only methods need no fresh bad values; the others heal what they are given.
    prepare: _Prepare = {name: inject if name in _HEALING else None for name in calls}
    before = site.totals()
    samples = timer.measure(calls, prepare, config.repeats, config.min_seconds)
    after = site.totals()
    median = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    median["floor"] = min(median["amax"], median["sum"])
    guard = median["guard"]
    ratios = {
        "guard_vs_floor": guard / median["floor"],
        "kernel_vs_floor": median["kernel"] / median["floor"],
        "sglang_vs_guard": median["sglang"] / guard,
        "nan_to_num_vs_guard": median["nan_to_num"] / guard,
    }
    one_read_us = None
    if bandwidth is not None:
        one_read_us = batch * config.vocab * x.element_size() / bandwidth * 1e6
        ratios["guard_vs_one_read"] = guard / one_read_us
    return CaseResult(
        batch=batch,
        dtype=str(dtype).removeprefix("torch."),
        state=state,
        dirty_rows=dirty_rows,
        median_us=median,
        samples=len(samples["guard"]),
        ratios=ratios,
        # Proof that every dirty call met fresh bad values: (timed + warm-up) calls x entries.
        guard_calls=after[CountKind.CALLS] - before[CountKind.CALLS],
        guard_healed=sum(after[k] - before[k] for k in (CountKind.NAN, CountKind.POSINF)),
        one_read_us=one_read_us,
    )


def _injector(
    x: torch.Tensor, rows: int, per_row: int, generator: torch.Generator
) -> Callable[[], None] | None:
    """Writes the same few NaN/+Inf entries into `rows` evenly spread rows: one indexed op."""
    if rows == 0:
        return None
    batch, vocab = x.shape
    row_ids = torch.linspace(0, batch - 1, rows).round().long()
    per_row = min(per_row, vocab)
    cols = torch.stack([torch.randperm(vocab, generator=generator)[:per_row] for _ in range(rows)])
    values = torch.full((rows, per_row), math.nan)
    values[:, ::2] = math.inf  # alternate: NaN and +Inf in every dirty row
    index = (row_ids.repeat_interleave(per_row).to(x.device), cols.reshape(-1).to(x.device))
    bad = values.reshape(-1).to(x.dtype).to(x.device)

    def inject() -> None:
        x.index_put_(index, bad)

    return inject


def _warm_up(calls: _Calls, prepare: _Prepare) -> None:
    for name, call in calls.items():  # first-call costs stay out
        setup = prepare[name]
        if setup is not None:
            setup()
        call()


def _rounds(repeats: int, min_seconds: float) -> Callable[[int], bool]:
    """Whether round `done` (0-based) runs: the first `repeats` always, then more while the
    case has run under `min_seconds` of host time, up to `_MAX_ROUNDS_PER_REPEAT` x repeats."""
    started = time.perf_counter()

    def more(done: int) -> bool:
        if done < repeats:
            return True
        return done < _MAX_ROUNDS_PER_REPEAT * repeats and (
            time.perf_counter() - started < min_seconds
        )

    return more


class _CpuTimer:
    method = (
        "time.perf_counter around each call; methods interleaved call by call, in a new "
        "random order every round (seeded); median"
    )

    def measure(
        self, calls: _Calls, prepare: _Prepare, repeats: int, min_seconds: float
    ) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {name: [] for name in calls}
        _warm_up(calls, prepare)
        clock = time.perf_counter
        names = list(calls)
        # Shuffled, not rotated: what runs just before a call moves its time here (the call
        # after `x.sum(-1)` took ~10 us more at B=8, whichever method it was; the call after
        # the SGLang-style pass runs on cold caches). A rotation keeps the cyclic order, so one
        # method always followed the same one (the guard followed `sum`); a shuffle gives
        # every method every predecessor alike.
        order = random.Random(_ORDER_SEED)
        more = _rounds(repeats, min_seconds)
        done = 0
        while more(done):
            order.shuffle(names)
            for name in names:
                call = calls[name]
                setup = prepare[name]
                if setup is not None:
                    setup()
                t0 = clock()
                call()
                samples[name].append(clock() - t0)
            done += 1
        return samples


class _CudaTimer:
    method = (
        "CUDA events around each call, after an L2 flush that keeps the GPU busy while the "
        "host queues the call; methods interleaved call by call; median"
    )

    def __init__(self, device: torch.device) -> None:
        self._flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def measure(
        self, calls: _Calls, prepare: _Prepare, repeats: int, min_seconds: float
    ) -> dict[str, list[float]]:
        _warm_up(calls, prepare)
        torch.cuda.synchronize()
        events: dict[str, list[tuple[Any, Any]]] = {name: [] for name in calls}
        # `min_seconds` counts host time: queuing runs ahead of the GPU by at most a few
        # calls (each one waits behind an L2 flush), so it tracks the GPU's time closely.
        more = _rounds(repeats, min_seconds)
        done = 0
        while more(done):
            for name, call in calls.items():
                setup = prepare[name]
                if setup is not None:
                    setup()
                self._flush.zero_()
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                call()
                end.record()
                events[name].append((start, end))
            done += 1
        torch.cuda.synchronize()
        return {
            name: [float(start.elapsed_time(end)) / 1e3 for start, end in pairs]
            for name, pairs in events.items()
        }


def _host_overhead(config: BenchConfig, site: Any, device: torch.device) -> HostOverhead:
    """Median host time of one guarded call on a tiny clean tensor (no device wait). On the
    CPU also that of the clean check alone (one sum and `.item()`, interleaved call by call)
    and the difference: what the guard's own Python costs on every call."""
    tiny = torch.randn(*config.tiny_shape, device=device)
    for _ in range(10):
        site(tiny)
    if device.type == "cuda":
        torch.cuda.synchronize()
    clock = time.perf_counter
    cpu = device.type == "cpu"
    samples, checks = [], []
    for _ in range(config.tiny_repeats):
        t0 = clock()
        site(tiny)
        samples.append(clock() - t0)
        if cpu:
            t0 = clock()
            math.isfinite(tiny.sum().item())
            checks.append(clock() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    median_us = statistics.median(samples) * 1e6
    if not cpu:
        return HostOverhead(shape=tuple(config.tiny_shape), median_us=median_us)
    check_us = statistics.median(checks) * 1e6
    return HostOverhead(
        shape=tuple(config.tiny_shape),
        median_us=median_us,
        check_us=check_us,
        own_us=median_us - check_us,
    )


def _copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(512 * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)
