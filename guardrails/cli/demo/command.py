"""`guardrails demo`: a tiny float16 serving loop surviving injected faults."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

# The sites the demo loop guards (see guardrails.cli.demo.loop).
DEMO_SITES = ("sampler.logits", "sampler.token_ids", "eagle.verify")


def _bounded(
    kind: Callable[[str], Any], low: float, high: float = math.inf
) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` within [low, high], else an error naming the range."""
    accepted = f">= {low:g}" if math.isinf(high) else f"from {low:g} to {high:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            message = f"expected a number {accepted}; got {text!r}"
            raise argparse.ArgumentTypeError(message) from None
        if not low <= value <= high:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {accepted}; got {text}")
        return value

    return parse


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="run a tiny float16 serving loop with injected faults, guarded",
        description=(
            "Serve generation requests on a tiny random-weight float16 decoder with faults "
            "injected (fp16 overflow, NaN/Inf glitches, over-masking, out-of-vocab ids, a "
            "degenerate draft branch). Honours every GUARDRAILS_* variable."
        ),
    )
    parser.add_argument(
        "--requests", type=_bounded(int, 1), default=48, help="requests to serve (>= 1)"
    )
    parser.add_argument(
        "--concurrency", type=_bounded(int, 1), default=8, help="rows per batch (>= 1)"
    )
    parser.add_argument("--max-new-tokens", type=_bounded(int, 2), default=24, help="(>= 2)")
    parser.add_argument("--vocab", type=_bounded(int, 16), default=32000, help="(>= 16)")
    parser.add_argument(
        "--fault-rate",
        type=_bounded(float, 0, 1),
        default=0.04,
        help="chance per step of each fault kind (0 to 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-guard", action="store_true", help="run the same loop without guardrails"
    )
    parser.add_argument(
        "--serve-after",
        type=_bounded(float, 0, 86400),
        default=0.0,
        metavar="SECONDS",
        help="keep serving /metrics this long after the loop ends (default 0: it ends with it)",
    )
    parser.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _configure_console_logs() -> None:
    # The demo is the host application here, so it may configure logging (the library never
    # does). Respect a host/GUARDRAILS_LOG_FORMAT choice that already configured structlog.
    import structlog

    if not structlog.is_configured():
        structlog.configure(
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        )


def run(args: argparse.Namespace) -> int:
    import guardrails as gr
    from guardrails.cli.demo.loop import DemoConfig, progress_bar, run_demo

    config = DemoConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        vocab=args.vocab,
        fault_rate=args.fault_rate,
        seed=args.seed,
        guard=not args.no_guard,
    )
    guards = None
    state = "OFF (--no-guard)"
    if config.guard:
        settings = gr.GuardSettings()
        if settings.enabled and "GUARDRAILS_METRICS_PORT" not in os.environ:
            settings = gr.GuardSettings(metrics={"port": _free_port()})
        if settings.reporting.log_format == "host":
            _configure_console_logs()
        guards = gr.Guardrails(settings)
        state = _state(settings)
        port = settings.metrics.port
        if port:
            ends = (
                f"until {args.serve_after:g} s after the loop"
                if args.serve_after > 0
                else "until the demo ends; --serve-after SECONDS keeps it up"
            )
            print(f"metrics: http://{settings.metrics.addr}:{port}/metrics ({ends})", flush=True)
    print(
        f"serving {config.requests} requests, {config.concurrency} at a time, on a tiny "
        f"float16 decoder (vocab {config.vocab}); fault rate {config.fault_rate:g} per step "
        f"per kind; guardrails {state}",
        flush=True,
    )
    try:
        started = time.perf_counter()
        result = run_demo(config, guards, progress=progress_bar(config.requests))
        wall = time.perf_counter() - started
        if guards is not None:
            guards.flush()  # exact totals in the counters before the summary and any scrape
        _summary(result, guards, wall)
        if guards is not None and args.serve_after > 0:
            print(f"serving metrics for {args.serve_after:g} s more", flush=True)
            time.sleep(args.serve_after)
    finally:
        # Also on Ctrl-C (the command line reports it): release the port, report the counts.
        if guards is not None:
            guards.close()
    return 1 if result.crashed else 0


def _state(settings: Any) -> str:
    if not settings.enabled:
        return "OFF (GUARDRAILS_ENABLED=false)"
    off = [name for name in DEMO_SITES if not settings.is_site_enabled(name)]
    if len(off) == len(DEMO_SITES):
        return f"OFF (every demo site disabled: {', '.join(off)})"
    return f"ON (off: {', '.join(off)})" if off else "ON"


def _summary(result: Any, guards: Any, wall: float) -> None:
    print()
    if result.crashed:
        print(f"SERVER CRASHED at {result.crashed}")
        print(f"  {result.tokens} tokens served before the crash")
    if result.garbage_tokens:
        print(f"  {result.garbage_tokens} rows would have streamed garbage under greedy decoding")
    rows = [
        ("steps", result.steps),
        ("tokens generated", result.tokens),
        ("requests finished", result.finished),
        ("requests aborted (flagged rows)", result.aborted),
        ("rows healed or flagged", result.rows_healed),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(result.injected.items()))),
        ("wall time", f"{wall:.1f} s"),
    ]
    guarding = guards is not None and guards.settings.enabled
    if guarding and result.step_seconds:
        share = 100 * result.guard_seconds / result.step_seconds
        rows.append(("guard time / step time", f"{share:.2f} %"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if not guarding:
        return
    print()
    print(f"{'site':<20} {'kind':<22} {'count':>8}")
    for (site, kind), value in sorted(guards.counts().items()):
        print(f"{site:<20} {kind:<22} {value:>8}")
