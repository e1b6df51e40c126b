"""A process tree under `guardrails run`, for tests/reporting/test_metrics_tree.py.

    guardrails run -- python -m tests.reporting.tree_workload MODE [ARGS]

The first process is the command itself; its children are started with multiprocessing's
spawn context (as SGLang starts its schedulers and vLLM its API servers), so each runs the
bootstrap on its own. Each process guards NaN logits at `sampler.logits` under its own `rank`
(process i guards 2**i NaN values), and the first process prints one JSON line of what it saw.

Modes:
- `port`: GUARDRAILS_METRICS_PORT is set for the whole tree; the children stay alive while
  the first process scrapes that port and asks the kernel which process listens on it (a
  process of the tree, or the one the server marker in the tree's directory names).
- `child-first`: GUARDRAILS_METRICS_PORT is set; the first process guards nothing itself: its
  one child guards and exits (the tree's first guarded process, gone), then the first process
  scrapes the port.
- `registry`: the host's own metrics in the first process's global registry, served the way a
  single-process host serves them (vLLM with one API server): the first process creates a
  counter of its own, its child guards, and the first process scrapes its global registry.
"""

from __future__ import annotations

import sys

# Before anything else: whether the bootstrap (already run by now) imported prometheus_client.
IMPORTED_AT_START = "prometheus_client" in sys.modules

import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import urllib.request  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

SITE = "sampler.logits"


def guard(rank: int) -> None:
    """Guard 2**rank NaN values at SITE in this process, under `rank`."""
    from guardrails.integrations.launcher import installed

    # Read when the process's first site is made, as torch.distributed's rank would be.
    os.environ["RANK"] = str(rank)
    guards = installed()
    assert guards is not None, "the bootstrap did not install guardrails here"
    logits = torch.zeros(1, 64)
    logits[0, : 2**rank] = math.nan
    guards.site(SITE)(logits)


def child_that_waits(rank: int, ready: Any, done: Any) -> None:
    guard(rank)
    ready.set()
    done.wait(120)


def child_that_exits(rank: int) -> None:
    guard(rank)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def marked_server(port: int) -> int:
    """The pid the server marker in the tree's directory names (0: no marker)."""
    path = os.path.join(os.environ["GUARDRAILS_METRICS_DIR"], f"guardrails_metrics_{port}.server")
    try:
        with open(path, encoding="ascii") as marker:
            return int(json.load(marker)["pid"])
    except OSError:
        return 0


def port_mode(children: int) -> dict[str, Any]:
    from guardrails.reporting.exposition import listens_on

    port = int(os.environ["GUARDRAILS_METRICS_PORT"])
    guard(0)
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    procs = []
    for rank in range(1, children + 1):
        ready = context.Event()
        proc = context.Process(target=child_that_waits, args=(rank, ready, done))
        proc.start()
        procs.append((proc, ready))
    for proc, ready in procs:
        if not ready.wait(120):
            raise SystemExit(f"child {proc.pid} never got ready (exit code {proc.exitcode})")
    pids = [os.getpid(), *(proc.pid for proc, _ in procs)]
    text = scrape(port)
    alive = [proc.is_alive() for proc, _ in procs]
    listening = [listens_on(pid, port) for pid in pids]
    server = marked_server(port)
    done.set()
    for proc, _ in procs:
        proc.join(120)
    return {
        "scrape": text,
        "alive_at_scrape": alive,
        "listening": listening,
        "marked_in_tree": server in pids,
        "marked_listening": listens_on(server, port) if server else False,
        "exitcodes": [proc.exitcode for proc, _ in procs],
    }


def child_first_mode() -> dict[str, Any]:
    port = int(os.environ["GUARDRAILS_METRICS_PORT"])
    proc = multiprocessing.get_context("spawn").Process(target=child_that_exits, args=(1,))
    proc.start()
    proc.join(120)
    return {"scrape": scrape(port), "exitcodes": [proc.exitcode]}


def registry_mode() -> dict[str, Any]:
    # The host's choice: prometheus_client imported in single-process mode, its own series
    # in the global registry, which it serves.
    from prometheus_client import REGISTRY, Counter, generate_latest, values

    host = Counter("host_requests", "The host's own counter.", ["route"])
    host.labels(route="/v1").inc(3)
    context = multiprocessing.get_context("spawn")
    proc = context.Process(target=child_that_exits, args=(1,))
    proc.start()
    proc.join(120)
    return {
        "scrape": generate_latest(REGISTRY).decode(),
        "exitcodes": [proc.exitcode],
        "multiprocess_mode": bool(getattr(values.ValueClass, "_multiprocess", False)),
    }


def main() -> None:
    mode = sys.argv[1]
    if mode == "port":
        result = port_mode(int(sys.argv[2]))
    elif mode == "child-first":
        result = child_first_mode()
    else:
        result = registry_mode()
    result["imported_at_start"] = IMPORTED_AT_START
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
