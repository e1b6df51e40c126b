"""The long version of the reliability suite (`make reliability`), and its figures.

    python -m benchmarks.reliability            # the long version (make reliability), ~8 min
    python -m benchmarks.reliability --quick    # the same steps at make-test sizes

`make test` runs the fuzz, fault and security tests and the soak and multiprocess-kill
workloads at small sizes. This runner runs the same test files with `RELIABILITY_FUZZ_SCALE`
examples per property (`tests/budget.py`), and the same workloads
(`tests/system/workloads.py`, which `tests/system/test_soak.py` runs) at full size: one
million guarded calls; four workers with long loops. It prints the figures that
`docs/reliability.md` records and exits non-zero if any check failed. One implementation of
each workload serves both, so the long version checks exactly what the short one checks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tests.system.workloads import SoakConfig, multiprocess_kill, soak

ROOT = Path(__file__).resolve().parent.parent

# -- the long-version runner ----------------------------------------------------------------

# Fuzz, fault and security tests: one pytest run, with more examples per property.
TEST_FILES = (
    "tests/contract/test_site_inputs.py",
    "tests/contract/test_token_ids.py",
    "tests/settings/test_fuzz_settings.py",
    "tests/system/test_faults.py",
    "tests/system/test_security.py",
)
_STAT = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


def hypothesis_cases(output: str) -> dict[str, int]:
    """Passing cases per test from `pytest --hypothesis-show-statistics` output."""
    cases: dict[str, int] = {}
    test = None
    for line in output.splitlines():
        if line.endswith(":") and "::" in line:
            test = line[:-1].strip()
        match = _STAT.search(line)
        if match and test is not None:
            cases[test] = cases.get(test, 0) + int(match[1])
    return cases


def _pytest(files: Sequence[str], env: Mapping[str, str], *extra: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *files],
        cwd=ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def failures(output: str) -> str:
    """pytest's report of what failed, whole: from the FAILURES (or ERRORS) section to the
    end, so that a falsifying example is never cut off by the statistics printed after the
    tests (`--hypothesis-show-statistics` goes before the summary, not inside it)."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if re.match(r"=+ (FAILURES|ERRORS) =+$", line):
            section = lines[index:]
            # The statistics section comes after the failures: leave it out, keep the summary.
            stats = next(
                (
                    i
                    for i, text in enumerate(section)
                    if re.match(r"=+ Hypothesis Statistics", text)
                ),
                None,
            )
            if stats is not None:
                summary = next(
                    (i for i, text in enumerate(section) if "short test summary info" in text),
                    len(section),
                )
                section = section[:stats] + section[max(summary, stats) :]
            return "\n".join(section)
    return output


def _summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1].strip("= ") if lines else "(no summary)"


@contextlib.contextmanager
def _step(name: str, report: dict[str, Any]) -> Iterator[dict[str, Any]]:
    print(f"== {name}", flush=True)
    started = time.perf_counter()
    entry: dict[str, Any] = {}
    yield entry
    entry["wall_s"] = round(time.perf_counter() - started, 1)
    report[name] = entry
    print(json.dumps(entry, indent=2, default=str), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability")
    parser.add_argument("--quick", action="store_true", help="make-test sizes (a smoke run)")
    parser.add_argument("--fuzz-scale", type=float, default=None, help="examples x this")
    parser.add_argument("--soak-calls", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    quick = args.quick
    scale = args.fuzz_scale if args.fuzz_scale is not None else (1.0 if quick else 40.0)
    soak_calls = args.soak_calls or (50_000 if quick else 1_000_000)
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "quick": quick,
    }
    failed: list[str] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}

    with _step("fuzz_faults_security", report) as entry:
        fuzz_env = {**env, "RELIABILITY_FUZZ_SCALE": str(scale)}
        code, output = _pytest(TEST_FILES, fuzz_env, "--hypothesis-show-statistics")
        cases = hypothesis_cases(output)
        entry.update(scale=scale, result=_summary_line(output), cases=cases)
        entry["total_cases"] = sum(cases.values())
        if code:
            failed.append("fuzz, fault or security tests failed:\n" + failures(output))

    with _step("soak", report) as entry:
        config = SoakConfig(calls=soak_calls, generations=4 if quick else 10)
        soak_result = soak(config)
        events = [n for n, _bound in soak_result.log_events.values()]
        bounds = [b for _n, b in soak_result.log_events.values()]
        entry.update(
            calls=soak_result.calls,
            threads=config.threads,
            generations=config.generations,
            dirty_calls_share=config.dirty,
            dirty_calls=soak_result.dirty_calls,
            nan_counted=sum(v["nan"] for v in soak_result.expected.values()),
            rows_no_valid_token=sum(
                v["rows_no_valid_token"] for v in soak_result.expected.values()
            ),
            log_events=sum(events),
            log_bound=sum(bounds),
            heap_growth_bytes=soak_result.heap_growth_bytes,
            rss_growth_bytes=soak_result.rss_growth_bytes,
            threads_before=soak_result.threads_before,
            threads_max=soak_result.threads_max,
            threads_after=soak_result.threads_after,
            soak_wall_s=round(soak_result.wall_s, 1),
            problems=soak_result.problems(),
        )
        failed += soak_result.problems()

    with _step("multiprocess_kill", report) as entry:
        rounds = []
        for seed in range(7, 8 if quick else 12):  # each round: another victim, kill point
            with tempfile.TemporaryDirectory() as tmp:
                directory = Path(tmp) / "multiproc"
                directory.mkdir()
                kill = multiprocess_kill(
                    directory,
                    calls=200 if quick else 20_000,
                    every=8 if quick else 32,
                    seed=seed,
                    victim=seed % 4,
                )
            rounds.append(
                {
                    "seed": seed,
                    "victim_rank": kill.victim,
                    "killed_at_call": kill.kill_at,
                    "victim_reported": kill.victim_printed,
                    "victim_counted_at_kill": kill.victim_full,
                    "aggregate": kill.aggregate,
                    "problems": kill.problems(),
                }
            )
            failed += kill.problems()
        entry.update(
            workers=4,
            calls_per_worker=200 if quick else 20_000,
            every_calls=8 if quick else 32,
            rounds=rounds,
        )

    report["failed"] = failed
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    print("\n".join(["== result", *(failed or ["all checks passed"])]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
