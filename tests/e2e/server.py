"""One `transformers serve` under `guardrails run`, on 127.0.0.1, stopped by its PID.

`guardrails run` execs the server, so the PID started here is the server's. It is also told to
die with the test process (PR_SET_PDEATHSIG, kept across exec), so a suite killed by its
timeout leaves no server behind.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "config" / "profiles" / "transformers-serve.toml"
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
# Continuous batching's KV cache otherwise takes a share of the machine's memory: a few
# blocks of 16 tokens are plenty for these requests.
CB_ARGS = ("--cb-block-size", "16", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "256")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Server:
    """A started server: `base_url`, `metrics_url`, `pid`, `log` (its stdout and stderr)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *extra: str,
        guarded: bool = True,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.port, self.metrics_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log = log
        serve = [str(BIN / "transformers"), "serve", self.model, "--device", "cpu"]
        serve += ["--dtype", "float16", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        launcher = [str(BIN / "guardrails"), "run", "--config", str(PROFILE), "--"]
        env = {key: value for key, value in os.environ.items() if not key.startswith("GUARDRAILS_")}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            # transformers serve has no /metrics: guardrails serves its own (one process).
            GUARDRAILS_METRICS_PORT=str(self.metrics_port),
            GUARDRAILS_REPORT_EVERY="1",  # counts reach /metrics at each call
            GUARDRAILS_STRICT_ATTACH="true",  # a point that does not resolve fails the start
            GUARDRAILS_LIVENESS_STEPS="8",  # the self-check judges every 8 decoding steps
        )
        env.update(settings or {})  # a test's own GUARDRAILS_* variables (tracing)
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [*launcher, *serve] if guarded else serve,
            cwd=log.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.pid = self.proc.pid
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                if self.health() == (200, {"status": "ok"}):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {START_TIMEOUT_S} s:\n{self.tail()}")

    def health(self) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=10) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            return str(reply.read().decode())

    def tail(self, chars: int = 4000) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._out.close()


@contextlib.contextmanager
def serving(
    model: Path,
    log: Path,
    *extra: str,
    guarded: bool = True,
    settings: dict[str, str] | None = None,
) -> Iterator[Server]:
    server = Server(model, log, *extra, guarded=guarded, settings=settings)
    try:
        yield server
    finally:
        server.stop()
