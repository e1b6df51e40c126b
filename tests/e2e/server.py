"""One real server's process tree, on 127.0.0.1, bounded in time and stopped by its process group.

Each engine's suite says how to start its server (`transformers serve` under `guardrails run
--config config/profiles/<engine>.toml`; vLLM's API server and SGLang's `launch_server` plainly,
guardrails coming in through their plugin entry points, or under `guardrails run`);
this module starts the command and owns it until `stop()`:

- in a session of its own (`start_new_session`), so the whole tree (vLLM's engine core and
  workers, SGLang's scheduler and detokenizer) is one process group, signalled as one; SGLang
  ends its own process group at shutdown, which must never be the test's;
- told to die with the test process (PR_SET_PDEATHSIG, kept across the launcher's exec), so a
  suite killed by its timeout leaves no server behind; the engines' children watch their parent;
- healthy when `GET /health` answers 200 within the start timeout, or the start fails with the
  log's tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "config" / "profiles"
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 240.0
# Every server this run started and how long it took to answer /health: the suite's summary.
STARTED: list[tuple[str, float]] = []
STOP_TIMEOUT_S = 30.0
# Reporting by time alone: no site ever ticks (a million calls between copies), so every count
# a test reads on such a server reached /metrics through the background poll, within
# REPORT_INTERVAL_S of its step, and nothing else.
REPORT_INTERVAL_S = 0.5
BY_TIME_ONLY = {
    "GUARDRAILS_REPORT_EVERY": "1000000",
    "GUARDRAILS_REPORT_INTERVAL_S": str(REPORT_INTERVAL_S),
}


# The engines' plugin allowlists: unset, every installed plugin loads (guardrails' included);
# the unguarded reference servers set theirs to name no plugin.
PLUGIN_ALLOWLISTS = ("VLLM_PLUGINS", "SGLANG_PLUGINS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def guarded(profile: str, command: Sequence[str]) -> list[str]:
    """`command` under `guardrails run --config config/profiles/<profile>.toml`."""
    config = str(PROFILES / f"{profile}.toml")
    return [str(BIN / "guardrails"), "run", "--config", config, "--", *command]


def server_env(settings: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """This process's environment without the developer's GUARDRAILS_* variables,
    multiprocess directory and engine plugin allowlists, offline, with the suite's own
    settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GUARDRAILS_")}
    for key in ("PROMETHEUS_MULTIPROC_DIR", *PLUGIN_ALLOWLISTS):
        env.pop(key, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    env.update(settings or {})
    return env


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Server:
    """A started server: `base_url`, `metrics_url`, `model` (the name requests use), `pid`,
    `log` (its stdout and stderr), `started_in_s` (seconds until healthy)."""

    def __init__(
        self,
        argv: Sequence[str],
        log: Path,
        *,
        port: int,
        model: str,
        env: Mapping[str, str],
        metrics_url: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.argv = list(argv)
        self.model = model
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.metrics_url = metrics_url or f"{self.base_url}/metrics"
        self.log = log
        self.poisoned_sent = 0
        self._out = log.open("wb")
        begun = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=log.parent,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pid = self.proc.pid
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - begun
        command = " ".join(Path(arg).name for arg in self.argv[:8])
        print(f"\n[e2e] {command} ...: healthy in {self.started_in_s:.1f} s")
        STARTED.append((command, self.started_in_s))

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                if self.health()[0] == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def health(self) -> tuple[int, Any]:
        """The status of GET /health and its body (JSON where it is JSON)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=10) as reply:
                return reply.status, _body(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _body(exc.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            return str(reply.read().decode())

    def tail(self, chars: int = 4000) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to what is left after the stop timeout."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        # The leader may be gone while its children linger: the group goes whole.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._out.close()


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")


@contextlib.contextmanager
def running(*args: Any, **kwargs: Any) -> Iterator[Server]:
    """A `Server` for the block, stopped at its end."""
    server = Server(*args, **kwargs)
    try:
        yield server
    finally:
        server.stop()
