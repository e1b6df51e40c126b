"""The bench's table of targets judges results as it says, and `min_seconds` sets the rounds."""

from __future__ import annotations

import dataclasses

import pytest

from guardrails.cli.bench import measure as bench
from guardrails.cli.bench.machine import Machine

CPU = Machine("linux", "3.11", "2", "a cpu", 2, 2, "cpu", None)
CUDA = dataclasses.replace(CPU, device="cuda:0", gpu="a gpu", gpu_sms=1, gpu_memory_gib=1.0)


def case(batch: int, dtype: str, state: str, guard: float, **ratios: float) -> bench.CaseResult:
    base = {"guard_vs_floor": 1.0, "sglang_vs_guard": 10.0, "nan_to_num_vs_guard": 1.0}
    median = {"guard": guard, "floor": 1.0, "sglang": 10.0, "nan_to_num": 1.0}
    return bench.CaseResult(
        batch, dtype, state, int(state == "dirty"), median, 5, {**base, **ratios}
    )


def result(machine: Machine, *cases: bench.CaseResult, host_us: float = 3.0) -> bench.BenchResult:
    return bench.BenchResult(
        machine=machine,
        config=bench.BenchConfig.smoke(),
        kernel="cpu",
        timing="t",
        host_overhead=bench.HostOverhead((4, 64), host_us),
        cases=cases,
    )


def verdicts(found: bench.BenchResult) -> dict[str, bool]:
    return {check.target: check.met for check in bench.check_targets(found)}


def test_every_cpu_target_is_met_by_a_result_inside_the_limits() -> None:
    found = result(
        CPU,
        case(8, "float32", "clean", 1.0, guard_vs_floor=1.3),
        case(8, "float32", "dirty", 2.0),
        case(8, "float16", "clean", 1.0, guard_vs_floor=2.5),
        case(8, "float16", "dirty", 1.5),
    )
    assert verdicts(found) == {t.name: True for t in bench.TARGETS if t.device == "cpu"}


@pytest.mark.parametrize(
    ("changed", "target"),
    [
        ({"guard_vs_floor": 1.31}, "clean float32/bfloat16 <= 1.3x floor"),
        ({"sglang_vs_guard": 7.9}, ">= 8x faster than the SGLang-style baseline (clean, B >= 8)"),
    ],
)
def test_a_value_past_its_limit_misses_that_target_only(
    changed: dict[str, float], target: str
) -> None:
    found = result(CPU, case(8, "float32", "clean", 1.0, **changed), case(8, "float32", "dirty", 1))
    missed = [name for name, met in verdicts(found).items() if not met]
    assert missed == [target]


def test_the_host_and_dirty_targets_read_their_own_numbers() -> None:
    found = result(
        CPU, case(1, "bfloat16", "clean", 1.0), case(1, "bfloat16", "dirty", 2.5), host_us=10.5
    )
    checks = {check.target: check for check in bench.check_targets(found)}
    assert not checks["host overhead <= 10 us per call"].met
    assert checks["host overhead <= 10 us per call"].measured == "10.50 us"
    assert not checks["1% dirty <= 2x clean"].met
    assert checks["1% dirty <= 2x clean"].measured == "bfloat16 B=1: 2.50x"
    # A batch below 8 has no SGLang target to check.
    assert ">= 8x faster than the SGLang-style baseline (clean, B >= 8)" not in checks


def test_a_cuda_result_is_judged_by_the_cuda_target_alone_and_names_the_worst_case() -> None:
    found = result(
        CUDA,
        case(1, "float32", "clean", 1.0, guard_vs_one_read=1.1, guard_vs_floor=9.0),
        case(8, "float16", "clean", 1.0, guard_vs_one_read=1.3),
    )
    [check] = bench.check_targets(found)
    assert check.target == "clean <= 1.2x one read at d2d bandwidth"
    assert not check.met
    assert check.measured.endswith("(worst float16 B=8)")
    assert "[MISS] clean <= 1.2x one read" in bench.summary(found)


@pytest.mark.parametrize(("min_seconds", "rounds"), [(0.0, 2), (1e9, 100)])
def test_min_seconds_adds_rounds_up_to_fifty_times_the_repeats(
    min_seconds: float, rounds: int
) -> None:
    # 0: exactly `repeats` rounds; a bound no run reaches: the cap, 50 x repeats.
    config = dataclasses.replace(
        bench.BenchConfig.smoke(),
        batches=(1,),
        dtypes=("float32",),
        vocab=16,
        repeats=2,
        min_seconds=min_seconds,
        tiny_repeats=5,
    )
    found = bench.run(config)
    assert [c.samples for c in found.cases] == [rounds, rounds]
