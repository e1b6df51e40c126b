"""Side-by-side benchmark of the guard (`guardrails bench`).

For each batch size, dtype and state (clean, or ceil(1%) of the rows dirty) it measures, in one
process and interleaved call by call, the median time of:

- `guard`: a real `LogitsSite` call through a `Guardrails` instance with default settings
  (reporting included): what users pay;
- `kernel`: the kernel that site chose, called directly with buffers of its own: `guard`
  minus `kernel` is what the site's layer costs, `kernel` minus `floor` what the kernel does
  beyond one read;
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

The parts: `results` (what is measured with and found: dataclasses until `to_json()`),
`harness` (the timers and probes; `run`), `machine` (what it ran on), `report` (the table and
the JSON file) and `verdict` (the table of targets and the check). This module is their front.
"""

from __future__ import annotations

from guardrails.cli.bench.harness import run
from guardrails.cli.bench.report import format_row, format_table, write_json
from guardrails.cli.bench.results import BenchConfig, BenchResult, CaseResult, HostOverhead
from guardrails.cli.bench.verdict import TARGETS, Check, check_targets, dirty_vs_clean, summary

__all__ = [
    "TARGETS",
    "BenchConfig",
    "BenchResult",
    "CaseResult",
    "Check",
    "HostOverhead",
    "check_targets",
    "dirty_vs_clean",
    "format_row",
    "format_table",
    "run",
    "summary",
    "write_json",
]
