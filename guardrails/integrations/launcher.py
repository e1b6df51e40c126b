"""What `guardrails run -- COMMAND` does, in the launcher and in every Python process it starts.

Launcher side (`prepare`): validate the settings the command will see (environment plus
config file, `[[attach]]` syntax included) and fail before anything starts; then put the
bootstrap directory first on `PYTHONPATH`, give the process tree a fresh metrics directory
(`own_metrics_dir`: `GUARDRAILS_METRICS_DIR`, when unset), start the tree's keeper (`own_tree`,
`guardrails.integrations.tree_keeper`: it serves `GUARDRAILS_METRICS_PORT` for the tree's
whole life and removes that directory when the command ends; a port it cannot bind is a
`ConfigError` before anything runs) and replace the launcher with the command (`exec`). The
environment dict is built for the command; `os.environ` is never written.

Process side (`bootstrap`, run by the bootstrap `sitecustomize`): build the process-wide
`guardrails.default()` from the environment, apply its attach points (pending ones apply
when their module is imported), install the configured engine hooks and the `[trace]`
probes on the models the engine builds, and close it at exit.
Nothing here imports prometheus_client (see `guardrails.reporting.metrics`): the engine makes
its own multiprocess choice after interpreter start.

A bad configuration ends the process at once with status 2 and the message on stderr: a
guard that silently did not install would be worse than no start. An attach point or hook
whose target does not resolve (another engine version) never stops the server: it is logged
(`guardrails.attach_error`) and counted in `guardrails_attach_errors_total{site, target}`,
and every other site stays guarded; `strict_attach` (GUARDRAILS_STRICT_ATTACH=true, for CI)
makes it exit with status 2 instead, as `guardrails check --strict` fails. What happens at run
time never stops it either: a tensor a patched target's site refuses, or a reference that
does not fit one call, is counted in `guardrails_guard_errors_total`, logged once, and the
engine's call goes on unguarded (see `guardrails.attach.patching`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from guardrails.exceptions import ConfigError
from guardrails.integrations import tree_keeper
from guardrails.reporting import exposition
from guardrails.settings import GuardSettings

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = [
    "BOOTSTRAP_DIR",
    "EXIT_CONFIG",
    "absolute_config_file",
    "bootstrap",
    "die",
    "installed",
    "launch",
    "own_metrics_dir",
    "own_tree",
    "prepare",
]

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"
EXIT_CONFIG = 2  # also what `guardrails` exits with on a ConfigError

_installed: Guardrails | None = None


def prepare(
    environ: Mapping[str, str], *, config_file: str | os.PathLike[str] | None = None
) -> tuple[dict[str, str], GuardSettings]:
    """The command's environment and the settings it will read; raises `ConfigError`."""
    env = dict(environ)
    if config_file is not None:
        env["GUARDRAILS_CONFIG_FILE"] = os.fspath(config_file)
    absolute_config_file(env)
    settings = GuardSettings(environ=env)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    bootstrap = str(BOOTSTRAP_DIR)
    env["PYTHONPATH"] = os.pathsep.join([bootstrap, *(p for p in entries if p != bootstrap)])
    return env, settings


def absolute_config_file(env: MutableMapping[str, str]) -> None:
    """Make `GUARDRAILS_CONFIG_FILE` in `env` absolute, so that a child started in another
    directory (a supervisor's `directory=`, Ray workers, `sh -c 'cd ...'`) reads the same
    file. Not resolved: a symlinked ConfigMap mount keeps following its updates."""
    raw = env.get("GUARDRAILS_CONFIG_FILE", "")
    if raw.strip():
        with contextlib.suppress(RuntimeError, ValueError):  # the settings say what is wrong
            env["GUARDRAILS_CONFIG_FILE"] = str(Path(raw).expanduser().absolute())


def own_metrics_dir(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with `GUARDRAILS_METRICS_DIR` naming a fresh, empty directory for the process
    tree, unless it is set already (then the directory is the caller's to wipe).

    Every guardrails process of the tree whose host has no multiprocess directory of its own
    writes its series there, and the engine's /metrics (or GUARDRAILS_METRICS_PORT) shows the
    whole tree's. The directory is the caller's to remove (`own_tree` has the tree's keeper
    remove it when the command ends)."""
    out = dict(env)
    if not out.get("GUARDRAILS_METRICS_DIR"):
        out["GUARDRAILS_METRICS_DIR"] = tempfile.mkdtemp(prefix="guardrails-metrics-")
    return out


def own_tree(
    env: Mapping[str, str], settings: GuardSettings
) -> tuple[dict[str, str], tree_keeper.Keeper | None]:
    """The command's environment with the tree's directory (`own_metrics_dir`), and the tree's
    keeper: started when the launcher made that directory (removed when the command ends) or
    `settings` ask for GUARDRAILS_METRICS_PORT (served until then); else None.

    A port the keeper cannot bind raises `ConfigError` naming the setting at fault, with the
    keeper gone and the directory removed: nothing runs. Any other failure of the keeper is
    reported on stderr and the command runs regardless (the tree's first process serves the
    port, as without a keeper). Call it last before `launch`: the keeper watches this
    process's pid."""
    made = not env.get("GUARDRAILS_METRICS_DIR")
    out = own_metrics_dir(env)
    metrics = settings.metrics
    if not made and not metrics.port:
        return out, None
    tree = out["GUARDRAILS_METRICS_DIR"]
    try:
        keeper = tree_keeper.start(
            out, remove=tree if made else None, tree=tree, addr=metrics.addr, port=metrics.port
        )
    except (OSError, UnicodeError) as exc:
        problem = exposition.bind_problem(
            exc,
            metrics.addr,
            metrics.port,
            addr_origin=settings.origin("metrics", "addr"),
            port_origin=settings.origin("metrics", "port"),
        )
        raise ConfigError([problem]) from exc
    if keeper.problem is not None:
        sys.stderr.write(
            f"guardrails run: the tree keeper: {keeper.problem}; the command runs regardless\n"
        )
    return out, keeper


def launch(argv: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Replace this process with `argv` (searched on PATH).

    exec, not a child process: signals reach the command directly, its exit status (or the
    signal that ended it) is the launcher's own, and supervisors keep the PID they started.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], list(argv), dict(env))


def installed() -> Guardrails | None:
    """The instance `bootstrap()` installed in this process, or None (not launched)."""
    return _installed


def bootstrap(installed_by: str = "launcher") -> Guardrails:
    """Install guardrails in this process; exits with status 2 on a configuration error.

    Once per process: a second call (the engine's plugin under `guardrails run`, a plugin
    loaded again) returns the instance the first installed, and a forked child keeps its
    parent's. `installed_by` goes into the start-up event ("launcher", "plugin:<engine>")."""
    global _installed
    if _installed is not None:
        return _installed
    from guardrails.service import default

    try:
        guards = default(installed_by=installed_by)
    except Exception as exc:  # a ConfigError, or anything else that leaves it unguarded
        die(exc)
    strict = guards.settings.strict_attach
    try:
        guards.attach_configured(on_error=die if strict else None)
        guards.install_hooks(on_error=die if strict else None)
        guards.trace_configured(on_error=die if strict else None)
    except Exception as exc:  # a guardrails bug: contained unless strict, never silent
        if strict:
            die(exc)
        guards.attach_errors.record(site="*", target="attach", error=exc)
    atexit.register(guards.close)
    _installed = guards
    return guards


def die(exc: Exception) -> NoReturn:
    """End this process now with status 2 and `exc` on stderr: the guard did not install."""
    # site.py reports an exception from sitecustomize as a warning and carries on, and an
    # import hook's exception may be caught by the code doing the import; neither may hide
    # a guard that did not install. os._exit: no SystemExit to intercept either.
    text = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    sys.stderr.write(f"guardrails: {text}\nguardrails: exiting (status {EXIT_CONFIG}).\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CONFIG)
