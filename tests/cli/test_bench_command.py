"""`guardrails bench --smoke` runs end to end and writes a complete result (never timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guardrails.cli.bench import measure as bench
from guardrails.cli.main import main

METHODS = {"guard", "kernel", "sglang", "nan_to_num", "amax", "sum", "floor"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], str]:
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:
        printed: list[str] = []
        patch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
        assert main(["bench", "--smoke", "--device", "cpu", "--out", str(out)]) == 0
    [path] = Path(out).glob("cpu-*.json")
    return json.loads(path.read_text()), "\n".join(printed)


def test_bench_smoke_measures_every_batch_dtype_and_state(
    smoke: tuple[dict[str, object], str],
) -> None:
    result, _ = smoke
    config = bench.BenchConfig.smoke()
    cases = result["cases"]
    assert isinstance(cases, list)
    keys = {(c["batch"], c["dtype"], c["state"]) for c in cases}
    assert keys == {
        (b, d, s) for b in config.batches for d in config.dtypes for s in ("clean", "dirty")
    }
    for case in cases:
        assert set(case["median_us"]) == METHODS
        assert all(value > 0 for value in case["median_us"].values())
        assert set(case["ratios"]) == {
            "guard_vs_floor",
            "kernel_vs_floor",
            "sglang_vs_guard",
            "nan_to_num_vs_guard",
        }


def test_bench_dirty_calls_each_heal_fresh_bad_values(smoke: tuple[dict[str, object], str]) -> None:
    result, _ = smoke
    per_row = bench.BenchConfig.smoke().bad_per_row
    for case in result["cases"]:  # type: ignore[attr-defined]
        expected = case["guard_calls"] * case["dirty_rows"] * per_row
        assert case["guard_healed"] == expected, case
        assert (case["dirty_rows"] > 0) == (case["state"] == "dirty")


def test_bench_result_records_the_machine_and_method(smoke: tuple[dict[str, object], str]) -> None:
    result, _ = smoke
    machine = result["machine"]
    assert isinstance(machine, dict)
    assert {"cpu", "torch", "platform", "device", "torch_threads"} <= set(machine)
    assert result["kernel"] == "cpu"
    assert "perf_counter" in str(result["timing"])
    host = result["host_overhead_us"]
    assert isinstance(host, dict)
    assert host["median_us"] > 0
    # On the CPU: the clean check alone, and the guard's own share, which add up.
    assert host["check_us"] > 0
    assert host["own_us"] == pytest.approx(host["median_us"] - host["check_us"])


def test_bench_prints_one_table_row_per_case(smoke: tuple[dict[str, object], str]) -> None:
    result, printed = smoke
    # The written file holds the whole result: read back, it shows the table that was printed.
    recorded = bench.BenchResult.from_json(result)
    assert json.loads(json.dumps(recorded.to_json())) == result
    table = bench.format_table(recorded)
    assert table in printed
    rows = [
        line
        for line in table.splitlines()
        if line.split()[:1] in (["float32"], ["bfloat16"], ["float16"])
    ]
    assert len(rows) == len(result["cases"])  # type: ignore[arg-type]


def test_bench_rejects_a_bad_batch_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--batches", "1,0"])
    assert "batch sizes must be >= 1" in capsys.readouterr().err


def test_a_row_shows_the_kernel_alone_and_a_dash_where_it_was_not_timed() -> None:
    times = {"guard": 12.0, "kernel": 10.5, "floor": 10.0, "sglang": 90.0, "nan_to_num": 9.0}
    ratios = {"guard_vs_floor": 1.2, "sglang_vs_guard": 7.5, "nan_to_num_vs_guard": 0.75}
    timed = bench.CaseResult(8, "float32", "clean", 0, times, 5, ratios)
    assert bench.format_row(timed).split()[3:6] == ["12.0", "10.5", "10.0"]
    # Results written before the kernel was timed on its own still print.
    del times["kernel"]
    older = bench.CaseResult(8, "float32", "clean", 0, times, 5, ratios)
    assert bench.format_row(older).split()[3:6] == ["12.0", "-", "10.0"]
