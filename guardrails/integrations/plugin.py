"""The engines' own way in: guardrails as a vLLM and an SGLang general plugin.

`pip install guardrails-logits` registers two entry points (pyproject.toml):

    vllm.general_plugins   guardrails = guardrails.integrations.plugin:vllm
    sglang.srt.plugins     guardrails = guardrails.integrations.plugin:sglang

Each engine calls its entry in every process it starts, before that process builds its
scheduler, workers or model (vLLM: the API server's `EngineArgs`, `EngineCore.__init__`,
`WorkerWrapperBase.init_worker`, Ray workers included; SGLang: `launch_server` / `Engine`, the
scheduler, the detokenizer, the DP controller). The entry does there what `guardrails run`'s
bootstrap does at interpreter start (`launcher.bootstrap`): sites, engine hooks, tracing,
heartbeat, reporting, with the same contract:

- Configuration: the file `GUARDRAILS_CONFIG_FILE` names, else the engine's profile shipped
  in the package (`profile(engine)`); `GUARDRAILS_*` as always. `GUARDRAILS_ENABLED=false`
  installs nothing that guards; the engine's allowlist (`VLLM_PLUGINS`, `SGLANG_PLUGINS`
  without `guardrails`) keeps the entry from being called at all.
- Once per process: a process `guardrails run` started (or a forked child of one the plugin
  installed) is left as it is; a second load is a no-op. The start-up event's `installed_by`
  says which way came first: "launcher" or "plugin:vllm" / "plugin:sglang".
- The process tree's metrics directory: the first process without `GUARDRAILS_METRICS_DIR`
  makes one and exports it to the processes it starts (they inherit `os.environ`), so the
  engine's /metrics shows every process's series, as under `guardrails run`; that process
  removes it at exit.
- A bad configuration ends the process with status 2 and the message on stderr (an engine
  that starts unguarded while its operator believes otherwise is worse than none starting);
  a point that does not fit the installed engine is counted and logged, not fatal, unless
  `GUARDRAILS_STRICT_ATTACH=true`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

from guardrails.exceptions import ConfigError, Problem
from guardrails.integrations import launcher

__all__ = ["ENGINES", "ENTRY_POINTS", "PROFILES", "install", "profile", "sglang", "vllm"]

PROFILES: Final = Path(__file__).resolve().parent.parent / "profiles"
# engine -> (entry-point group, the engine's allowlist variable); the entry's name is
# `ENTRY_NAME` in both groups.
ENTRY_POINTS: Final = {
    "vllm": ("vllm.general_plugins", "VLLM_PLUGINS"),
    "sglang": ("sglang.srt.plugins", "SGLANG_PLUGINS"),
}
ENGINES: Final = tuple(ENTRY_POINTS)
ENTRY_NAME: Final = "guardrails"


def profile(engine: str) -> Path:
    """The profile shipped for `engine` ("vllm", "sglang", "transformers",
    "transformers-serve")."""
    path = PROFILES / f"{engine}.toml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml")))
        raise ConfigError(
            [Problem("profile", "no shipped profile of that name", engine, f"one of {shipped}")]
        )
    return path


def vllm() -> None:
    """vLLM's `vllm.general_plugins` entry."""
    install("vllm")


def sglang() -> None:
    """SGLang's `sglang.srt.plugins` entry."""
    install("sglang")


def install(engine: str) -> None:
    """Install guardrails in this process for `engine`, as its plugin (see the module
    docstring); a process that has it already is left as it is."""
    if launcher.installed() is not None:
        return
    env = os.environ
    if not env.get("GUARDRAILS_CONFIG_FILE", "").strip():
        env["GUARDRAILS_CONFIG_FILE"] = str(profile(engine))
    launcher.absolute_config_file(env)
    if not env.get("GUARDRAILS_METRICS_DIR") and _enabled():
        _own_metrics_dir(env)
    launcher.bootstrap(installed_by=f"plugin:{engine}")


def _enabled() -> bool:
    """`GUARDRAILS_ENABLED` and the config file say guardrails is on; a configuration
    error ends the process, as `bootstrap` would."""
    from guardrails.settings import GuardSettings

    try:
        return GuardSettings().enabled
    except ConfigError as exc:
        launcher.die(exc)


def _own_metrics_dir(env: os._Environ[str]) -> None:
    directory = tempfile.mkdtemp(prefix="guardrails-metrics-")
    env["GUARDRAILS_METRICS_DIR"] = directory
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # never a forked child's exit
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
