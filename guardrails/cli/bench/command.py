"""`guardrails bench`: the guard side by side with the SGLang-style sanitizer and the floor.

Prints the ratio table (once: progress goes to stderr as one short line per case) and the
issue's targets, and, only when asked with `--out DIR`, writes the full result (machine,
versions, every median) as JSON there. `--smoke` runs tiny tensors in a few seconds, to check
that the benchmark works, not to measure. A machine already busy (load average above half its
cores) gets a warning first: its timings would be noise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="benchmark the guard against an SGLang-style sanitizer and one read of the logits",
        description="Median time of a guarded call, its kernel alone, the SGLang-style "
        "sanitizer, nan_to_num_ alone and the floor (amax or sum), for B in --batches x V x "
        "dtype x {clean, 1%% dirty}.",
    )
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda or auto (cuda when available; default)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the full result as JSON into DIR (e.g. benchmarks/results)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny tensors, a few seconds")
    parser.add_argument(
        "--batches", type=_batches, default=None, help="comma-separated batch sizes (1,8,64,256)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case")
    parser.add_argument(
        "--no-json", action="store_true", help="write no file, even with --out (the default)"
    )
    parser.set_defaults(func=run)


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,64; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1; got {text!r}")
    return values


def load_warning(load: float, cores: int) -> str | None:
    """A warning when the 1-minute load average says other work competes for the cores."""
    if load <= 0.5 * cores:
        return None
    return (
        f"guardrails bench: warning: this machine is busy (load average {load:.2f} on "
        f"{cores} core{'s' if cores != 1 else ''}); timings will be noisy, run it on a quiet one"
    )


def _check_load() -> None:
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return
    warning = load_warning(load, os.cpu_count() or 1)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from guardrails.cli.bench import measure as bench

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        print(
            f"guardrails bench: --device must be cpu, cuda or auto; got {device!r}", file=sys.stderr
        )
        return 2
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("guardrails bench: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    config = bench.BenchConfig.smoke(device) if args.smoke else bench.BenchConfig(device=device)
    if args.batches is not None:
        config = dataclasses.replace(config, batches=args.batches)
    if args.repeats is not None:
        if args.repeats < 1:
            print("guardrails bench: --repeats must be >= 1", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, repeats=args.repeats)
    _check_load()
    total = len(config.dtypes) * len(config.batches) * 2
    done = [0]

    def progress(case: bench.CaseResult) -> None:
        done[0] += 1
        print(
            f"measured {case.dtype} B={case.batch} {case.state} ({done[0]}/{total})",
            file=sys.stderr,
            flush=True,
        )

    result = bench.run(config, progress=progress)
    print(bench.format_table(result))
    if not args.smoke:  # tiny tensors say nothing about the targets
        print()
        print(bench.summary(result))
    if args.out is not None and not args.no_json:
        path = bench.write_json(result, args.out)
        print(f"\nwrote {path}")
    return 0
