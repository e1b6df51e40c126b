"""What origin tracing costs a decode step on the CPU: traced / untraced, side by side.

    .venv/bin/python benchmarks/trace_cost.py [--repeats 7]

A decode step here is one token per row through a transformers Llama (`model(ids[B, 1])`,
no KV cache: the step's matmuls without attention over a long context), then the sampler's
guarded site on its logits (reporting every 32 calls, as by default), so the reporter's reads
of the trace state are in the figures. Each repetition times one step of every variant in
turn, on copies of the same model, so drift falls on all alike; medians are reported.

Variants: untraced; `always` over `model.layers.*` (13 modules per layer, each probed on
input and output); `always` over `model.layers.*.mlp` (one module per layer); `every:16`
over `model.layers.*`; `armed` while clean (its hooks are on, each only tests the switch until a
site's first hit).

Shapes: "small" (the tests' tiny Llama: 2 layers, hidden 64, B=8, float32) and "7b-layer"
(a stand-in for 32 layers, hidden 4096, B=8: two real decoder layers of that shape,
intermediate 11008, 32 heads, float32; 32 such layers, 26 GB, do not fit this machine. The
probes and the layers both cost per layer, so the two-layer ratio stands for the 32-layer one;
the per-step latch, one vectorised pass over all rows, is included once as in the real model).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from guardrails import Guardrails, GuardSettings  # noqa: E402
from guardrails.logs import SilentLogger  # noqa: E402

VARIANTS = {
    "untraced": None,
    "always layers.*": (["model.layers.*"], "always"),
    "always layers.*.mlp": (["model.layers.*.mlp"], "always"),
    "every:16 layers.*": (["model.layers.*"], "every:16"),
    "armed (clean)": (["model.layers.*"], "armed"),
}


# The two shapes' Llama configurations (see the module docstring).
SHAPES: dict[str, dict[str, int]] = {
    "small": {
        "vocab_size": 200,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "7b-layer": {
        "vocab_size": 1024,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
}


def build(shape: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, **SHAPES[shape])
    return LlamaForCausalLM(config).eval()


def stepper(model: torch.nn.Module, guards: Guardrails, ids: torch.Tensor) -> Callable[[], float]:
    site = guards.site("sampler.logits")

    def step() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
        site(logits)
        return time.perf_counter() - start

    return step


def measure(shape: str, repeats: int, batch: int = 8) -> dict[str, float]:
    base = build(shape)
    ids = torch.randint(5, 200, (batch, 1))
    steps: dict[str, Callable[[], float]] = {}
    keep = []
    for name, how in VARIANTS.items():
        model = base if how is None else copy.deepcopy(base)
        guards = Guardrails(GuardSettings(), registry=CollectorRegistry(), logger=SilentLogger())
        if how is not None:
            keep.append(guards.trace(model, how[0], mode=how[1]))
        keep.append(guards)
        steps[name] = stepper(model, guards, ids)
    for step in steps.values():  # warm-up
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(step())
    return {name: statistics.median(values) for name, values in times.items()}


def probe_costs(rows: int = 32 * 13, batch: int = 8, hidden: int = 4096) -> dict[str, float]:
    """Seconds per call of the probe op on a [B, 1, hidden] float32 output (and input), and of
    the per-step latch over `rows` rows: the traced cost of a 32-layer step, measured without
    the layer's own noise around it."""
    from guardrails.tracing import ops
    from tests.tracing.models import AlwaysProbing

    tracer = AlwaysProbing()
    key = ops.register(tracer)
    state = ops.new_state(rows + 1, torch.device("cpu"))
    x = torch.randn(batch, 1, hidden)
    probe = torch.ops.guardrails.trace_probe_
    latch = torch.ops.guardrails.trace_latch_
    n = 2000

    def per_call(call: Callable[[], None], count: int) -> float:
        for _ in range(count // 10):
            call()
        start = time.perf_counter()
        for _ in range(count):
            call()
        return (time.perf_counter() - start) / count

    return {
        "probe_s": per_call(lambda: ops.write_probe(state, x, x, 3), n),  # eager hooks
        "probe_op_s": per_call(lambda: probe(state, x, x, 3, key), n),  # compiled code
        "latch_s": per_call(lambda: latch(state, key), n // 10),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default="small,7b-layer")
    # One thread by default: on a shared 2-core machine two torch threads wait on each other
    # whenever another process holds a core, and medians then swing by 2x between runs.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for shape in args.shapes.split(","):
        repeats = args.repeats * 20 if shape == "small" else args.repeats
        medians = measure(shape, repeats)
        base = medians["untraced"]
        results[shape] = {
            name: {"median_ms": value * 1e3, "ratio": value / base}
            for name, value in medians.items()
        }
        threads = torch.get_num_threads()
        print(f"{shape} (B=8, float32, {repeats} steps each, torch threads={threads})")
        for name, value in medians.items():
            print(f"  {name:22s} {value * 1e3:9.3f} ms   x{value / base:.3f}")
        if shape != "small":
            costs = probe_costs()
            layer = base / 2  # the stand-in has two layers
            traced = costs["rows"] * costs["probe_s"] + costs["latch_s"]
            estimate = 1 + traced / (32 * layer)
            results["32-layer estimate"] = {**costs, "layer_s": layer, "ratio": estimate}
            print(
                f"  32 layers x 13 modules: {costs['rows']} probes x "
                f"{costs['probe_s'] * 1e6:.1f} us (the op, as compiled code calls it: "
                f"{costs['probe_op_s'] * 1e6:.1f} us) + latch {costs['latch_s'] * 1e6:.1f} us = "
                f"{traced * 1e3:.2f} ms per step on 32 x {layer * 1e3:.0f} ms of layers: "
                f"x{estimate:.4f}"
            )
    out = ROOT / "benchmarks" / "results" / "trace_cost.json"
    out.write_text(
        json.dumps(
            {"machine": platform.processor() or platform.machine(), "results": results},
            indent=2,
        )
        + "\n"
    )
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
