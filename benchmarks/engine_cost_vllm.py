"""The guard's cost as a share of vLLM's own `Sampler.forward` step, on the same batch.

    .engines/vllm-0.33.0/bin/python -m benchmarks.engine_cost_vllm [--reps N] [--calls N]

vLLM 0.33.0's real Sampler (on CPU its PyTorch-native path), float32 logits of V=151936 (a
Qwen-sized vocabulary), B in {1, 8, 64}, greedy and top-k/top-p. Guarded means the vLLM
profile's [[attach]] entries applied (sampler.logits on the logits Sampler.forward receives,
sampler.token_ids on the ids it returns), as `guardrails run` applies them. Guarded and
unguarded runs are interleaved rep by rep (patches applied and removed between reps, outside
the timed region), so drift in the machine's speed hits both alike; each call gets a fresh
copy of the same clean logits (the sampler divides them by the temperature in place). The
figure is the median over reps of (guarded - unguarded) / unguarded. Writes
benchmarks/results/engine_cost_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import guardrails as gr
from tests.engines.vllm.faults import PROFILE, metadata

VOCAB = 151936
BATCHES = (1, 8, 64)
MODES = ("greedy", "top-k/top-p")
OUT = Path(__file__).resolve().parent / "results" / "engine_cost_vllm.json"


def _time_calls(
    sampler: Any, source: torch.Tensor, work: torch.Tensor, md: Any, calls: int
) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        work.copy_(source)
        sampler(work, md)
    return (time.perf_counter() - start) / calls


def measure(batch: int, mode: str, *, reps: int, calls: int) -> dict[str, Any]:
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    source = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch))
    work = torch.empty_like(source)
    md = metadata(mode, rows=batch)
    md.generators = {}  # the common case: no per-request seeds
    guards = gr.Guardrails(
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}),
        registry=CollectorRegistry(),
    )
    _time_calls(sampler, source, work, md, 2)  # warm-up, unguarded
    shares, bare, guarded = [], [], []
    for _ in range(reps):
        handles = guards.attach_configured()
        _time_calls(sampler, source, work, md, 1)  # first guarded call sizes the site buffers
        g = _time_calls(sampler, source, work, md, calls)
        for handle in handles:
            handle.remove()
        u = _time_calls(sampler, source, work, md, calls)
        guarded.append(g)
        bare.append(u)
        shares.append((g - u) / u)
    guards.close()
    return {
        "batch": batch,
        "mode": mode,
        "vocab": VOCAB,
        "dtype": "float32",
        "unguarded_ms": statistics.median(bare) * 1e3,
        "guarded_ms": statistics.median(guarded) * 1e3,
        "guard_share": statistics.median(shares),
        "reps": reps,
        "calls_per_rep": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    # On a small shared machine a 2-thread OpenMP reduction can wait milliseconds for its
    # second core; one thread measures the work itself.
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import vllm

    rows = []
    for mode in MODES:
        for batch in BATCHES:
            row = measure(batch, mode, reps=args.reps, calls=args.calls)
            rows.append(row)
            print(
                f"{mode:<12} B={batch:<3} Sampler.forward {row['unguarded_ms']:8.2f} ms  "
                f"guarded {row['guarded_ms']:8.2f} ms  guard share {row['guard_share']:+.1%}",
                flush=True,
            )
    result = {
        "engine": f"vllm {vllm.__version__}",
        "torch": torch.__version__,
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "results": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
