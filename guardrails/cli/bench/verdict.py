"""The targets a benchmark result is checked against, in one table, and the check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from guardrails.cli.bench.results import BenchResult

__all__ = ["TARGETS", "Check", "Target", "check_targets", "dirty_vs_clean", "summary"]


@dataclass(frozen=True)
class Target:
    """One target: `measure` of the matching cases must stay at most (or at least) `limit`.

    `measure` is a clean case's ratio (`guard_vs_floor`, `guard_vs_one_read`,
    `sglang_vs_guard`), `dirty_vs_clean` (the guard's dirty time over its clean time, per
    dtype and batch) or `host_us` (the host overhead of one call)."""

    name: str
    device: Literal["cpu", "cuda"]
    measure: str
    limit: float
    at_most: bool = True
    dtypes: tuple[str, ...] | None = None  # None: every dtype
    min_batch: int = 0
    unit: str = "x"
    digits: int = 2
    show_worst: bool = False  # name the case farthest from the limit after the values


TARGETS: Final = (
    Target(
        "clean <= 1.2x one read at d2d bandwidth",
        "cuda",
        "guard_vs_one_read",
        1.2,
        show_worst=True,
    ),
    Target(
        "clean float32/bfloat16 <= 1.3x floor",
        "cpu",
        "guard_vs_floor",
        1.3,
        dtypes=("float32", "bfloat16"),
    ),
    Target("clean float16 <= 2.5x floor", "cpu", "guard_vs_floor", 2.5, dtypes=("float16",)),
    Target(
        ">= 8x faster than the SGLang-style baseline (clean, B >= 8)",
        "cpu",
        "sglang_vs_guard",
        8,
        at_most=False,
        min_batch=8,
        digits=1,
    ),
    Target("host overhead <= 10 us per call", "cpu", "host_us", 10, unit=" us"),
    Target("1% dirty <= 2x clean", "cpu", "dirty_vs_clean", 2),
)


@dataclass(frozen=True)
class Check:
    target: str
    met: bool
    measured: str


def dirty_vs_clean(result: BenchResult) -> dict[tuple[str, int], float]:
    """Guard time with dirty rows over guard time clean, per (dtype, batch)."""
    clean = {(c.dtype, c.batch): c.median_us["guard"] for c in result.cases if c.state == "clean"}
    return {
        (c.dtype, c.batch): c.median_us["guard"] / clean[(c.dtype, c.batch)]
        for c in result.cases
        if c.state == "dirty"
    }


def _values(target: Target, result: BenchResult) -> list[tuple[str, float]]:
    if target.measure == "host_us":
        return [("", result.host_overhead.median_us)]
    if target.measure == "dirty_vs_clean":
        return [(f"{d} B={b}", v) for (d, b), v in dirty_vs_clean(result).items()]
    return [
        (f"{c.dtype} B={c.batch}", c.ratios[target.measure])
        for c in result.cases
        if c.state == "clean"
        and c.batch >= target.min_batch
        and (target.dtypes is None or c.dtype in target.dtypes)
    ]


def check_targets(result: BenchResult) -> list[Check]:
    """Each target of the result's device whose cases were measured, met or not."""
    device = "cuda" if result.on_cuda else "cpu"
    checks = []
    for target in TARGETS:
        if target.device != device:
            continue
        values = _values(target, result)
        if not values:
            continue
        if target.at_most:
            met = all(value <= target.limit for _, value in values)
        else:
            met = all(value >= target.limit for _, value in values)
        shown = ", ".join(
            (f"{label}: " if label else "") + f"{value:.{target.digits}f}{target.unit}"
            for label, value in values
        )
        if target.show_worst:
            pick = max if target.at_most else min
            shown += f" (worst {pick(values, key=lambda item: item[1])[0]})"
        checks.append(Check(target.name, met, shown))
    return checks


def summary(result: BenchResult, checks: Sequence[Check] | None = None) -> str:
    """Lines checking the targets against `result` (CPU or CUDA ones)."""
    found = list(checks) if checks is not None else check_targets(result)
    return "\n".join(f"[{'ok' if c.met else 'MISS'}] {c.target}: {c.measured}" for c in found)
