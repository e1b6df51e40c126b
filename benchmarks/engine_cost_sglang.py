"""The guard's cost as a share of SGLang's own Sampler.forward on the same batch (CPU).

    .engines/sglang-0.5.23/bin/python benchmarks/engine_cost_sglang.py [--repeats 15]

V = 151936 (Qwen's vocabulary), B in {1, 8, 64}, greedy and top-k/top-p, float32. Each
repetition times one unguarded and one guarded Sampler.forward on fresh copies of the same
clean logits, in alternating order, so drift (turbo, other load) falls on both alike; the
guard is the profile's attach points and hook, applied around each guarded call and removed
after it (patching is not timed; the sites and their buffers persist across repetitions).
Reports the median of each and the ratio guarded/unguarded - 1; writes
benchmarks/results/engine_cost_sglang.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engines" / "stubs")]

import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from guardrails import Guardrails  # noqa: E402
from tests.engines.sglang.engine import (  # noqa: E402
    VERSION,
    clean_logits,
    load_engine,
    profile_settings,
    sample,
)

VOCAB = 151936
BATCHES = (1, 8, 64)
MODES = ("greedy", "top_k_top_p")


def time_once(engine: object, logits: torch.Tensor, mode: str) -> float:
    work = logits.clone()
    start = time.perf_counter()
    sample(engine, work, mode)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/engine_cost_sglang.json"
    )
    args = parser.parse_args()
    engine = load_engine()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for batch in BATCHES:
        logits = clean_logits(torch.float32, rows=batch, vocab=VOCAB)
        for mode in MODES:
            plain: list[float] = []
            guard: list[float] = []
            # One Guardrails for the whole series: its sites (and their buffers, sized by the
            # warm-up call) persist while the patches come and go between repetitions.
            guards = Guardrails(profile_settings(), registry=CollectorRegistry())
            for rep in range(args.repeats + 1):
                order = (False, True) if rep % 2 == 0 else (True, False)
                for on in order:
                    if not on:
                        seconds = time_once(engine, logits, mode)
                        if rep:
                            plain.append(seconds)
                        continue
                    handles = [*guards.attach_configured(), *guards.install_hooks()]
                    seconds = time_once(engine, logits, mode)
                    for handle in reversed(handles):
                        handle.remove()
                    if rep:  # rep 0 warms both paths up
                        guard.append(seconds)
            assert guards.count("sampler.logits", "calls") == args.repeats + 1
            guards.close()
            unguarded_ms = statistics.median(plain) * 1e3
            guarded_ms = statistics.median(guard) * 1e3
            row = {
                "batch": batch,
                "vocab": VOCAB,
                "mode": mode,
                "dtype": "float32",
                "unguarded_ms": round(unguarded_ms, 3),
                "guarded_ms": round(guarded_ms, 3),
                "overhead": round(guarded_ms / unguarded_ms - 1, 4),
                "repeats": args.repeats,
            }
            rows.append(row)
            print(
                f"B={batch:3d} {mode:12s} sampler {unguarded_ms:8.3f} ms  guarded "
                f"{guarded_ms:8.3f} ms  overhead {row['overhead']:+.1%}",
                flush=True,
            )
    result = {
        "engine": f"sglang {VERSION}",
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "method": "median of interleaved single calls; guarded = the profile's attach points "
        "and hook installed; overhead = guarded/unguarded - 1",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
