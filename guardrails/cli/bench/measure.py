"""Side-by-side benchmark of the guard (`guardrails bench`).

For each batch size, dtype and state (clean, or ceil(1%) of the rows dirty) it measures, in one
process and interleaved call by call, the median time of:

- `guard`: a real `LogitsSite` call through a `Guardrails` instance with default settings
  (reporting included): what users pay;
- `sglang`: the SGLang-style sanitizer (`isnan(x).any()` added into a device counter, a
  non-blocking copy to a host mirror, then `nan_to_num_(nan=-1e30, posinf=1e30,
  neginf=-1e30)`);
- `nan_to_num`: `nan_to_num_` alone, with the same constants;
- `floor`: the faster of `x.amax(-1)` and `x.sum(-1)` on the same tensor.

Dirty calls get fresh bad values before every timed call (outside the timed region), so each
one really heals. CPU timings use `time.perf_counter` around each call; CUDA timings use a pair
of CUDA events around each call, after an L2 flush that also lets the host queue the call
ahead (so host launch overhead is not counted; it is reported separately). On CUDA the
device-to-device copy bandwidth is measured too, and the guard's clean time is compared with
one read of the tensor at that bandwidth.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from guardrails.flags import CountKind
from guardrails.kernels.select import select_logits_kernel

__all__ = ["BenchConfig", "check_targets", "format_table", "run", "summary", "write_json"]

METHODS = ("guard", "sglang", "nan_to_num", "amax", "sum")
_SGLANG_NAN, _SGLANG_POSINF, _SGLANG_NEGINF = -1e30, 1e30, -1e30
_FLUSH_BYTES = 256 * 2**20  # larger than any GPU's L2 cache today


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. `repeats` timed calls per method and case (medians reported)."""

    batches: tuple[int, ...] = (1, 8, 64, 256)
    vocab: int = 151936
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    device: str = "cpu"
    repeats: int = 60
    min_seconds: float = 0.3  # per case: more repeats for fast cases, steadier medians
    dirty_fraction: float = 0.01
    bad_per_row: int = 5  # NaN and +Inf entries written into each dirty row
    tiny_shape: tuple[int, int] = (4, 64)
    tiny_repeats: int = 2000

    @classmethod
    def smoke(cls, device: str = "cpu") -> BenchConfig:
        """A few seconds: tiny tensors, few repeats (structure, not numbers)."""
        return cls(
            batches=(1, 3),
            vocab=1000,
            device=device,
            repeats=5,
            min_seconds=0.0,
            tiny_repeats=50,
        )


@dataclass
class CaseResult:
    batch: int
    dtype: str
    state: str
    dirty_rows: int
    median_us: dict[str, float]
    samples: int
    ratios: dict[str, float] = field(default_factory=dict)
    guard_calls: int = 0
    guard_healed: int = 0


def run(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure everything `config` asks for; returns the JSON-able result."""
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
        for dtype_name in config.dtypes:
            dtype = getattr(torch, dtype_name)
            for batch in config.batches:
                for state in ("clean", "dirty"):
                    case = _measure_case(config, site, timer, batch, dtype, state, device)
                    cases.append(case)
                    if progress is not None:
                        progress(_row(asdict(case)))
        host = _host_overhead(config, site, device)
        bandwidth = _copy_bandwidth(device) if device.type == "cuda" else None
    finally:
        guards.close()
    result: dict[str, Any] = {
        "machine": _machine(device),
        "config": asdict(config),
        "kernel": select_logits_kernel(device).name,  # the choice the site made
        "timing": timer.method,
        "host_overhead_us": host,
        "cases": [asdict(c) for c in cases],
    }
    if bandwidth is not None:
        result["d2d_copy_bandwidth_gbs"] = bandwidth / 1e9
        for case, raw in zip(cases, result["cases"], strict=True):
            itemsize = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
            one_read_us = case.batch * config.vocab * itemsize / bandwidth * 1e6
            raw["one_read_us"] = one_read_us
            raw["ratios"]["guard_vs_one_read"] = case.median_us["guard"] / one_read_us
    return result


def _measure_case(
    config: BenchConfig,
    site: Any,
    timer: _CpuTimer | _CudaTimer,
    batch: int,
    dtype: torch.dtype,
    state: str,
    device: torch.device,
) -> CaseResult:
    generator = torch.Generator().manual_seed(batch * 7919 + config.vocab)
    # Logits-like values: mostly negative, a few large; never overflowing float16 chunk sums.
    x = (torch.randn(batch, config.vocab, generator=generator) * 4 - 3).to(dtype).to(device)
    dirty_rows = math.ceil(config.dirty_fraction * batch) if state == "dirty" else 0
    inject = _injector(x, dirty_rows, config.bad_per_row, generator)
    counter = torch.zeros((), dtype=torch.int64, device=device)
    mirror = torch.zeros((), dtype=torch.int64, pin_memory=device.type == "cuda")

    def sglang() -> None:
        counter.add_(torch.isnan(x).any())
        mirror.copy_(counter, non_blocking=True)
        x.nan_to_num_(nan=_SGLANG_NAN, posinf=_SGLANG_POSINF, neginf=_SGLANG_NEGINF)

    calls: dict[str, Callable[[], object]] = {
        "guard": lambda: site(x),
        "sglang": sglang,
        "nan_to_num": lambda: x.nan_to_num_(
            nan=_SGLANG_NAN, posinf=_SGLANG_POSINF, neginf=_SGLANG_NEGINF
        ),
        "amax": lambda: x.amax(-1),
        "sum": lambda: x.sum(-1),
    }
    # Read-only methods need no fresh bad values; the others heal what they are given.
    prepare = {
        name: inject if name in ("guard", "sglang", "nan_to_num") else None for name in calls
    }
    before = site.totals()
    samples = timer.measure(calls, prepare, config.repeats, config.min_seconds)
    after = site.totals()
    median = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    median["floor"] = min(median["amax"], median["sum"])
    guard = median["guard"]
    ratios = {
        "guard_vs_floor": guard / median["floor"],
        "sglang_vs_guard": median["sglang"] / guard,
        "nan_to_num_vs_guard": median["nan_to_num"] / guard,
    }
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


class _CpuTimer:
    method = (
        "time.perf_counter around each call; methods interleaved call by call, the order "
        "rotated every round; median"
    )

    def measure(
        self,
        calls: dict[str, Callable[[], object]],
        prepare: dict[str, Callable[[], None] | None],
        repeats: int,
        min_seconds: float,
    ) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for name, call in calls.items():  # warm-up: first-call costs stay out
            if prepare[name] is not None:
                prepare[name]()  # type: ignore[misc]
            call()
        clock = time.perf_counter
        started = clock()
        done = 0
        names = list(calls)
        while done < repeats or (clock() - started < min_seconds and done < 50 * repeats):
            # Rotated: a call right after the SGLang-style one (1-2 ms of passes and a large
            # temporary) runs on colder caches; every method takes that place in turn.
            shift = done % len(names)
            for name in names[shift:] + names[:shift]:
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
        self,
        calls: dict[str, Callable[[], object]],
        prepare: dict[str, Callable[[], None] | None],
        repeats: int,
        min_seconds: float,
    ) -> dict[str, list[float]]:
        for name, call in calls.items():
            if prepare[name] is not None:
                prepare[name]()  # type: ignore[misc]
            call()
        torch.cuda.synchronize()
        events: dict[str, list[tuple[Any, Any]]] = {name: [] for name in calls}
        for _ in range(repeats):
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
        torch.cuda.synchronize()
        return {
            name: [float(start.elapsed_time(end)) / 1e3 for start, end in pairs]
            for name, pairs in events.items()
        }


def _host_overhead(config: BenchConfig, site: Any, device: torch.device) -> dict[str, Any]:
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
    result: dict[str, Any] = {
        "shape": list(config.tiny_shape),
        "median_us": statistics.median(samples) * 1e6,
    }
    if cpu:
        result["check_us"] = statistics.median(checks) * 1e6
        result["own_us"] = result["median_us"] - result["check_us"]
    return result


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


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_sms"] = props.multi_processor_count
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _row(case: dict[str, Any]) -> str:
    m, r = case["median_us"], case["ratios"]
    line = (
        f"{case['dtype']:<9} {case['batch']:>4} {case['state']:<5} {m['guard']:>10.1f} "
        f"{m['floor']:>10.1f} {r['guard_vs_floor']:>7.2f}x {m['sglang']:>10.1f} "
        f"{r['sglang_vs_guard']:>7.1f}x {m['nan_to_num']:>10.1f}"
    )
    if "one_read_us" in case:
        line += f" {case['one_read_us']:>10.1f} {r['guard_vs_one_read']:>6.2f}x"
    return line


def format_table(result: dict[str, Any]) -> str:
    """The ratio table, as plain text."""
    machine = result["machine"]
    where = machine.get("gpu") or machine["cpu"]
    lines = [
        f"guardrails bench on {where} ({machine['device']}, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads, kernel {result['kernel']})",
        f"timing: {result['timing']}",
        "",
        f"{'dtype':<9} {'B':>4} {'state':<5} {'guard us':>10} {'floor us':>10} "
        f"{'g/floor':>8} {'sglang us':>10} {'sgl/g':>8} {'n2n us':>10}"
        + (f" {'1 read us':>10} {'g/read':>7}" if "d2d_copy_bandwidth_gbs" in result else ""),
    ]
    lines += [_row(case) for case in result["cases"]]
    host = result["host_overhead_us"]
    line = f"host overhead per call ({host['shape']} tensor): {host['median_us']:.2f} us"
    if "own_us" in host:
        line += (
            f" (the clean check alone {host['check_us']:.2f} us; "
            f"the guard's own {host['own_us']:.2f} us)"
        )
    lines += ["", line]
    if "d2d_copy_bandwidth_gbs" in result:
        lines.append(
            f"device-to-device copy bandwidth: {result['d2d_copy_bandwidth_gbs']:.0f} GB/s"
        )
    return "\n".join(lines)


def dirty_vs_clean(result: dict[str, Any]) -> dict[tuple[str, int], float]:
    """Guard time with dirty rows over guard time clean, per (dtype, batch)."""
    clean = {
        (c["dtype"], c["batch"]): c["median_us"]["guard"]
        for c in result["cases"]
        if c["state"] == "clean"
    }
    return {
        (c["dtype"], c["batch"]): c["median_us"]["guard"] / clean[(c["dtype"], c["batch"])]
        for c in result["cases"]
        if c["state"] == "dirty"
    }


def write_json(result: dict[str, Any], directory: Path) -> Path:
    """Write `result` to `directory/<device>-<machine>-<utc time>.json`; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    machine = result["machine"]
    name = (machine.get("gpu") or machine["cpu"]).lower()
    slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    kind = "cuda" if machine["device"].startswith("cuda") else "cpu"
    path = directory / f"{kind}-{slug[:60]}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


def summary(result: dict[str, Any], targets: Sequence[tuple[str, bool, str]] | None = None) -> str:
    """Lines checking the issue's targets against `result` (CPU or CUDA ones)."""
    checks = list(targets) if targets is not None else check_targets(result)
    return "\n".join(f"[{'ok' if ok else 'MISS'}] {name}: {detail}" for name, ok, detail in checks)


def check_targets(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """`(target, met, measured)` for each target of the one-pass issue."""
    cases = result["cases"]
    clean = [c for c in cases if c["state"] == "clean"]
    checks: list[tuple[str, bool, str]] = []
    if result["machine"]["device"].startswith("cuda"):
        worst = max(clean, key=lambda c: c["ratios"]["guard_vs_one_read"])
        checks.append(
            (
                "clean <= 1.2x one read at d2d bandwidth",
                all(c["ratios"]["guard_vs_one_read"] <= 1.2 for c in clean),
                ", ".join(
                    f"{c['dtype']} B={c['batch']}: {c['ratios']['guard_vs_one_read']:.2f}x"
                    for c in clean
                )
                + f" (worst {worst['dtype']} B={worst['batch']})",
            )
        )
        return checks
    for dtypes, limit in ((("float32", "bfloat16"), 1.3), (("float16",), 2.5)):
        group = [c for c in clean if c["dtype"] in dtypes]
        if group:
            checks.append(
                (
                    f"clean {'/'.join(dtypes)} <= {limit}x floor",
                    all(c["ratios"]["guard_vs_floor"] <= limit for c in group),
                    ", ".join(
                        f"{c['dtype']} B={c['batch']}: {c['ratios']['guard_vs_floor']:.2f}x"
                        for c in group
                    ),
                )
            )
    big = [c for c in clean if c["batch"] >= 8]
    if big:
        checks.append(
            (
                ">= 8x faster than the SGLang-style baseline (clean, B >= 8)",
                all(c["ratios"]["sglang_vs_guard"] >= 8 for c in big),
                ", ".join(
                    f"{c['dtype']} B={c['batch']}: {c['ratios']['sglang_vs_guard']:.1f}x"
                    for c in big
                ),
            )
        )
    host = result["host_overhead_us"]["median_us"]
    checks.append(("host overhead <= 10 us per call", host <= 10, f"{host:.2f} us"))
    dirty = dirty_vs_clean(result)
    checks.append(
        (
            "1% dirty <= 2x clean",
            all(v <= 2 for v in dirty.values()),
            ", ".join(f"{d} B={b}: {v:.2f}x" for (d, b), v in dirty.items()),
        )
    )
    return checks
