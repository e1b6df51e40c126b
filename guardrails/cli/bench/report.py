"""How a benchmark result is shown: the ratio table, and the JSON file it is kept in."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from guardrails.cli.bench.results import BenchResult, CaseResult

__all__ = ["format_row", "format_table", "write_json"]


def format_row(case: CaseResult) -> str:
    """One case's line of the table."""
    m, r = case.median_us, case.ratios
    # Results written before the kernel was timed on its own have no kernel figures.
    kernel = f"{m['kernel']:>10.1f}" if "kernel" in m else f"{'-':>10}"
    line = (
        f"{case.dtype:<9} {case.batch:>4} {case.state:<5} {m['guard']:>10.1f} {kernel} "
        f"{m['floor']:>10.1f} {r['guard_vs_floor']:>7.2f}x {m['sglang']:>10.1f} "
        f"{r['sglang_vs_guard']:>7.1f}x {m['nan_to_num']:>10.1f}"
    )
    if case.one_read_us is not None:
        line += f" {case.one_read_us:>10.1f} {r['guard_vs_one_read']:>6.2f}x"
    return line


def format_table(result: BenchResult) -> str:
    """The ratio table, as plain text."""
    machine = result.machine
    cuda = result.d2d_copy_bandwidth_gbs is not None
    lines = [
        f"guardrails bench on {machine.name} ({machine.device}, torch {machine.torch}, "
        f"{machine.torch_threads} threads, kernel {result.kernel})",
        f"timing: {result.timing}",
        "",
        f"{'dtype':<9} {'B':>4} {'state':<5} {'guard us':>10} {'kernel us':>10} {'floor us':>10} "
        f"{'g/floor':>8} {'sglang us':>10} {'sgl/g':>8} {'n2n us':>10}"
        + (f" {'1 read us':>10} {'g/read':>7}" if cuda else ""),
    ]
    lines += [format_row(case) for case in result.cases]
    host = result.host_overhead
    line = f"host overhead per call ({list(host.shape)} tensor): {host.median_us:.2f} us"
    if host.check_us is not None and host.own_us is not None:
        line += (
            f" (the clean check alone {host.check_us:.2f} us; the guard's own {host.own_us:.2f} us)"
        )
    lines += ["", line]
    if result.d2d_copy_bandwidth_gbs is not None:
        lines.append(f"device-to-device copy bandwidth: {result.d2d_copy_bandwidth_gbs:.0f} GB/s")
    return "\n".join(lines)


def write_json(result: BenchResult, directory: Path) -> Path:
    """Write `result` to `directory/<device>-<machine>-<utc time>.json`; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "-" for ch in result.machine.name.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    kind = "cuda" if result.on_cuda else "cpu"
    path = directory / f"{kind}-{slug[:60]}-{stamp}.json"
    path.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return path
