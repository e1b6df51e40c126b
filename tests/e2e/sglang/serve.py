"""SGLang's `launch_server` (0.5.23, its CPU engine) on 127.0.0.1, started three ways (`way`):

- "plugin" (the default): plainly, as an operator's image does, with guardrails installed in
  the venv and no configuration: SGLang loads guardrails' `sglang.srt.plugins` entry in each
  process it starts (`load_plugins()`), which installs the shipped SGLang profile;
- "launcher": under `guardrails run --config config/profiles/sglang.toml` (the plugin loads
  too, and finds guardrails installed already);
- "unguarded": plainly, with `SGLANG_PLUGINS` naming only another plugin (`NO_GUARDRAILS`):
  SGLang's own allowlist leaves guardrails out.

The CPU engine is chosen by `SGLANG_USE_CPU_ENGINE=1` (`--device cpu` alone does not); with
`--attention-backend torch_native` and no CUDA graphs it serves the tiny bfloat16 Llama in
15-30 s on 2 cores (50 s on a busy machine): the HTTP process, `sglang::scheduler` (one per
TP rank) and `sglang::detokenizer`, one process group. The server's processes import two labelled
stand-ins from PYTHONPATH: `sgl_kernel` (tests/e2e/sglang/stubs; the registry has no CPU
build) and `torchvision` (tests/engines/stubs; the registry's wheel needs CUDA torch). SGLang
serves guardrails' series itself on its own /metrics (`--enable-metrics`: every process writes
into SGLang's multiprocess directory), so no GUARDRAILS_METRICS_PORT.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from guardrails.integrations.sglang import ABORT_MESSAGE
from tests.e2e.client import Outcome
from tests.e2e.server import BIN, ROOT, Server, free_port, guarded, running, server_env

STUBS = (ROOT / "tests" / "e2e" / "sglang" / "stubs", ROOT / "tests" / "engines" / "stubs")
# The CPU engine's flags; the KV pool is sized by tokens (65536 of a 2-layer, 2-KV-head model:
# a few MB), not by a share of the machine's memory. `--sleep-on-idle`: an idle scheduler
# otherwise polls its sockets without pause, a whole core per idle server.
CPU_ARGS = (
    "--sleep-on-idle",
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--mem-fraction-static",
    "0.1",
    "--max-total-tokens",
    "65536",
)
# SGLang reads an empty SGLANG_PLUGINS as "every plugin": an allowlist without guardrails must
# name something else.
NO_GUARDRAILS = "not-guardrails"
GUARDED_SETTINGS = {
    "GUARDRAILS_REPORT_EVERY": "1",  # counts reach /metrics at each call
    "GUARDRAILS_STRICT_ATTACH": "true",  # a point that does not resolve fails the start
    "GUARDRAILS_LIVENESS_STEPS": "8",  # the self-check judges every 8 sampling steps
}


@contextlib.contextmanager
def serving(
    model: Path,
    log: Path,
    *extra: str,
    way: Literal["plugin", "launcher", "unguarded"] = "plugin",
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """The server for the block, started `way`, stopped at its end; `extra` goes to
    launch_server, `env` into the server's environment (over the guarded settings)."""
    port = free_port()
    launch = [str(BIN / "python"), "-m", "sglang.launch_server", "--model-path", str(model)]
    launch += [*CPU_ARGS, "--enable-metrics", "--host", "127.0.0.1", "--port", str(port), *extra]
    # `guardrails run` puts its bootstrap directory first and keeps these after it.
    path = [str(stub) for stub in STUBS] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    settings = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join(path)}
    if way == "unguarded":
        settings["SGLANG_PLUGINS"] = NO_GUARDRAILS
    else:
        settings.update(GUARDED_SETTINGS)
    settings.update(env or {})  # the caller's word is the last
    with running(
        guarded("sglang", launch) if way == "launcher" else launch,
        log,
        port=port,
        model=str(model),
        env=server_env(settings),
    ) as server:
        yield server


def flush_cache(server: Server, timeout_s: float = 30.0) -> tuple[int, str]:
    """SGLang's `POST /flush_cache` (empties the prefix cache), retried while SGLang refuses
    it with 400 because a request is still running: its last status and text."""
    request = urllib.request.Request(f"{server.base_url}/flush_cache", method="POST")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                return exc.code, exc.read().decode()
        time.sleep(0.5)


# What a guarded server is expected to show.
ABORTED = re.compile(r"guardrails\.request_aborted .*\bstatus=503\b")  # one per request
# Every guard and hook half the profile attaches on this path, watched by the liveness check.
WATCHED = {
    "sampler.logits",
    "sampler.token_ids",
    "sglang.abort_poisoned_requests",
    "sglang.abort_poisoned_requests:results",
}


def assert_aborted(outcome: Outcome, streamed: bool = False) -> None:
    """The client saw guardrails' abort: HTTP 503 with SGLang's error body (non-streamed), or
    an error event and no content (streamed)."""
    error = outcome.error
    assert error is not None, f"answered {outcome.text!r} ({outcome.finish_reason})"
    body: Any = error.body
    assert isinstance(body, dict), body
    assert (body.get("message"), body.get("code")) == (ABORT_MESSAGE, 503), body
    if streamed:
        # SGLang's final chunk: data: {"error": {..., "type": "SERVICE_UNAVAILABLE"}}
        assert body.get("type") == "SERVICE_UNAVAILABLE", body
        assert (outcome.text, outcome.content_chunks, outcome.finish_reason) == ("", 0, None)
        assert outcome.chunks_after_error == 0
    else:
        assert getattr(error, "status_code", None) == 503, error


def aborted_in_log(server: Server) -> int:
    """The requests guardrails' hook aborted, by its `guardrails.request_aborted` events."""
    return len(ABORTED.findall(server.log.read_text(errors="replace")))


def wait_for_log(count: Callable[[], int], expected: int, timeout_s: float = 30.0) -> int:
    """`count()` once it reaches `expected` (the scheduler's log line may land after the
    client's answer)."""
    deadline = time.monotonic() + timeout_s
    value = count()
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.25)
        value = count()
    return value
