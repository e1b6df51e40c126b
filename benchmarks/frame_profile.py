"""guardrails' own host time inside a real server's processes, from a deterministic profile.

A vLLM general plugin (vLLM loads `vllm.general_plugins` entry points in its engine core and in
each worker, in the process's main thread, where both run their busy loops) that profiles that
thread with `cProfile` between two signals: SIGUSR1 starts, SIGUSR2 stops and writes
`<FRAME_PROFILE_DIR>/<pid>.prof`. `plugin_dir()` writes the module and a `.dist-info` naming its
entry point into a directory for `PYTHONPATH` (importlib.metadata finds distributions on any
`sys.path` entry), so the server needs nothing installed. `guardrails_time()` reads a profile
back: the seconds spent in guardrails' code, its own frames and the C functions (torch ops)
those frames call, without the engine code guardrails wraps (the original method a patch
wrapper calls is the engine's time).

cProfile costs every Python and C call a fraction of a microsecond, guardrails' and the
engine's alike, so a profiled step is slower than a plain one; `benchmarks.vllm_server_cost`
reports both guardrails' seconds per profiled step and that share applied to the unprofiled
step time.
"""

from __future__ import annotations

import pstats
import shutil
from pathlib import Path
from typing import Any

PACKAGE = str(Path(__file__).resolve().parents[1] / "guardrails") + "/"
MODULE = "guardrails_frame_profile"
DIR_VARIABLE = "FRAME_PROFILE_DIR"
# Where an engine's own code lives: what guardrails' wrappers call is not guardrails' time.
ENGINE_PARTS = ("/vllm/", "/sglang/", "/transformers/")


def install() -> None:  # pragma: no cover - runs inside the server's processes
    """The plugin's entry point: SIGUSR1 starts profiling the main thread, SIGUSR2 writes it."""
    import cProfile
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread; vLLM loads plugins there
    out = Path(os.environ[DIR_VARIABLE])
    profiler = cProfile.Profile()

    def start(signum: int, frame: Any) -> None:
        profiler.enable()

    def stop(signum: int, frame: Any) -> None:
        profiler.disable()
        profiler.dump_stats(str(out / f"{os.getpid()}.prof"))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def plugin_dir(where: Path) -> Path:
    """A directory for `PYTHONPATH` holding this module as `guardrails_frame_profile` and a
    distribution whose `vllm.general_plugins` entry point is its `install`."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(__file__, where / f"{MODULE}.py")
    info = where / f"{MODULE}-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\nframe_profile = {MODULE}:install\n"
    )
    return where


def _ours(function: tuple[str, int, str]) -> bool:
    return function[0].startswith(PACKAGE)


def _engine(function: tuple[str, int, str]) -> bool:
    return any(part in function[0] for part in ENGINE_PARTS)


def guardrails_time(path: Path) -> dict[str, Any]:
    """From one profile: `seconds` in guardrails' code, the `calls` of its functions, the
    `total` seconds profiled (every function's own time), and `calls_of` by function name.

    guardrails' seconds are its frames' own time, plus what the functions they call directly
    cost where guardrails called them: a C function's own time (torch ops), a library Python
    function's time with all it calls (torch, the standard library). The engine functions
    guardrails calls are not counted: they are the original methods its wrappers call.
    """
    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    calls = 0
    total = 0.0
    named: dict[str, int] = {}
    # Per guardrails function: [its own time plus its direct callees' as above, its calls].
    by_function: dict[str, list[float]] = {}

    def charge(function: tuple[str, int, str], seconds: float, ncalls: int = 0) -> None:
        name = f"{function[0].removeprefix(PACKAGE)}:{function[1]}({function[2]})"
        entry = by_function.setdefault(name, [0.0, 0])
        entry[0] += seconds
        entry[1] += ncalls

    for function, (_, ncalls, own, _, callers) in stats.items():
        total += own
        named[function[2]] = named.get(function[2], 0) + ncalls
        if _ours(function):
            charge(function, own, ncalls)
            calls += ncalls
        elif not _engine(function):
            # A C function ("~") may call back into Python (a torch op's Python kernel): its
            # own time only, the kernel's frames count for themselves.
            column = 2 if function[0] == "~" else 3
            for caller, row in callers.items():
                if _ours(caller):
                    charge(caller, row[column])
    seconds = sum(entry[0] for entry in by_function.values())
    top = sorted(by_function.items(), key=lambda item: -item[1][0])
    return {
        "seconds": seconds,
        "calls": calls,
        "total": total,
        "calls_of": named,
        "functions": [(name, entry[0], int(entry[1])) for name, entry in top],
    }
