"""Fault injection: each fault handled as documented, and the sampling call still heals and
counts. Real processes where the fault lives in process state (prometheus multiprocess mode
is fixed at import; the launcher snapshots settings at start-up).

- metrics port taken: `ConfigError` at start-up naming the variable; instances already
  running keep guarding.
- multiprocess directory unusable (at start-up, or broken mid-run): the guard heals and
  counts, the failure is counted and logged once (`guardrails.reporting_error`,
  stage=metrics). Tests run as root in CI, where a mode-0o500 directory stops nothing, so the
  directory is made unusable in ways that stop root too: a path under a regular file
  (ENOTDIR), and a file-size limit of 0 (EFBIG, as a full disk would fail it).
- structlog processors raising: contained; counted in `guardrails_reporting_errors_total`.
- config file changed or deleted after start-up: settings are a snapshot; no effect.
- attach target module failing to import: the host's import raises the host's error, the
  patch stays pending and applies once the module imports.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry

from guardrails import ConfigError, Guardrails, GuardSettings
from guardrails.testing import fresh_guardrails

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
LAUNCH = (sys.executable, "-m", "guardrails", "run")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(extra)
    return env


def run_python(
    code: str, env: dict[str, str], *, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def result_line(stdout: str) -> Any:
    """The child's JSON line (the first line of its stdout that is a JSON object)."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


def nan_logits() -> torch.Tensor:
    x = torch.zeros(2, 8)
    x[0, :3] = math.nan
    return x


# -- the metrics port ----------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_taken_metrics_port_fails_at_start_naming_the_variable(taken_port: int) -> None:
    with pytest.raises(ConfigError, match=r"GUARDRAILS_METRICS_PORT=\d+: cannot serve metrics"):
        fresh_guardrails(environ={"GUARDRAILS_METRICS_PORT": str(taken_port)})


def test_running_guard_keeps_guarding_when_another_cannot_bind(taken_port: int) -> None:
    registry = CollectorRegistry()
    with fresh_guardrails(registry=registry) as running:
        site = running.site("sampler.logits")
        site(nan_logits())
        threads = threading.active_count()
        with pytest.raises(ConfigError):
            fresh_guardrails(environ={"GUARDRAILS_METRICS_PORT": str(taken_port)})
        x = nan_logits()
        flags = site(x)
        assert flags.tolist() == [1, 0]
        assert bool((x[0, :3] == -math.inf).all())
        assert threading.active_count() == threads  # the failed one left no server thread
    labels = {"site": "sampler.logits", "kind": "nan", "rank": "0"}
    assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 6


# -- the multiprocess directory --------------------------------------------------------------

# The first sampling call builds the default instance and its site: the case that used to
# raise from inside the sampling call (FileNotFoundError/NotADirectoryError from
# prometheus-client creating its file).
FIRST_CALL = r"""
import json, math, sys
import torch
import guardrails as gr

gr.configure_json_logs(sys.stderr)
x = torch.zeros(2, 8)
x[0, :3] = math.nan
flags = gr.sanitize_logits_(x).clone()  # a view of the site's buffer until its next call
x2 = torch.zeros(2, 8)
x2[1, 5] = math.inf
gr.sanitize_logits_(x2)
counts = {kind: n for (_site, kind), n in gr.default().counts().items()}
print(json.dumps({
    "flags": flags.tolist(),
    "healed": bool((x[0, :3] == -math.inf).all()) and bool(x2.isfinite().all()),
    "counts": counts,
}))
"""


# Prepended to the child's code, before anything is imported: even root cannot write past
# RLIMIT_FSIZE, and ignoring SIGXFSZ turns such a write into an EFBIG error instead of a kill.
# (Pipes are not files: the child's output still arrives.)
NO_ROOM = (
    "import resource, signal\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
)


def _error_events(stderr: str) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "guardrails.reporting_error"]


@pytest.mark.parametrize("fault", ["under_a_regular_file", "no_room_to_write"])
def test_unusable_multiprocess_directory_never_reaches_the_sampling_call(
    tmp_path: Path, fault: str
) -> None:
    if fault == "under_a_regular_file":
        (tmp_path / "file").write_text("", encoding="utf-8")
        directory, code, errno_name = tmp_path / "file" / "multiproc", FIRST_CALL, "Not a directory"
    else:
        directory, code, errno_name = tmp_path / "multiproc", NO_ROOM + FIRST_CALL, "File too large"
        directory.mkdir()
    done = run_python(code, base_env(PROMETHEUS_MULTIPROC_DIR=str(directory)))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["flags"] == [1, 0]
    assert result["healed"]
    assert result["counts"]["nan"] == 3
    assert result["counts"]["posinf"] == 1
    assert result["counts"]["calls"] == 2
    errors = _error_events(done.stderr)
    assert len(errors) == 1, done.stderr  # logged once, however often it recurs
    assert errors[0]["stage"] == "metrics"
    assert errno_name in errors[0]["error"]


BROKEN_MID_RUN = r"""
import json, math, os, shutil, sys
import torch
import guardrails as gr
from prometheus_client import REGISTRY

gr.configure_json_logs(sys.stderr)
guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1}))
site = guards.site("sampler.logits")

def call(site):
    x = torch.zeros(2, 8)
    x[1, :2] = math.nan
    site(x)
    return bool((x[1, :2] == -math.inf).all())

healed = [call(site)]
directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
shutil.rmtree(directory)
open(directory, "w").close()  # the directory is now a regular file
healed += [call(site) for _ in range(4)]
late = guards.site("late.logits")  # series made after the break
healed.append(call(late))
guards.close()
exported = REGISTRY.get_sample_value(
    "guardrails_nonfinite_values_total", {"site": "sampler.logits", "kind": "nan", "rank": "0"}
)
print(json.dumps({"healed": healed, "counts": guards.count("sampler.logits", "nan"),
                  "late": guards.count("late.logits", "nan"), "exported": exported}))
"""


def test_multiprocess_directory_broken_mid_run_leaves_calls_and_counters_intact(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "multiproc"
    directory.mkdir()
    done = run_python(BROKEN_MID_RUN, base_env(PROMETHEUS_MULTIPROC_DIR=str(directory)))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["healed"] == [True] * 6
    assert result["counts"] == 10
    assert result["late"] == 2
    # prometheus-client keeps writing through the mapping of its (now unlinked) file.
    assert result["exported"] == 10
    assert _error_events(done.stderr) == []


# -- structlog processors raising -------------------------------------------------------------


def _explode(logger: Any, method: str, event: Any) -> Any:
    raise RuntimeError("processor exploded")


@pytest.fixture
def raising_processors() -> Iterator[None]:
    structlog.configure(processors=[_explode])
    try:
        yield
    finally:
        structlog.reset_defaults()


def _logged_guardrails(registry: CollectorRegistry) -> Guardrails:
    # logger=None: the instance logs through structlog.get_logger, i.e. the host's config.
    return fresh_guardrails(registry=registry, reporting={"every_calls": 1})


@pytest.mark.usefixtures("raising_processors")
def test_raising_structlog_processor_never_reaches_the_sampling_call() -> None:
    registry = CollectorRegistry()
    with _logged_guardrails(registry) as guards:
        site = guards.site("sampler.logits")
        for _ in range(5):
            x = nan_logits()
            assert site(x).tolist() == [1, 0]
            assert bool((x[0, :3] == -math.inf).all())
        assert guards.count("sampler.logits", "nan") == 15
    labels = {"site": "sampler.logits", "kind": "nan", "rank": "0"}
    assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 15


@pytest.mark.usefixtures("raising_processors")
def test_raising_structlog_processor_is_counted_as_a_logs_error() -> None:
    registry = CollectorRegistry()
    with _logged_guardrails(registry) as guards:
        for _ in range(3):
            guards.site("sampler.logits")(nan_logits())
    # Two events were due (the first hit at once; the two held back, at close()): both failed.
    labels = {"stage": "logs", "rank": "0"}
    assert registry.get_sample_value("guardrails_reporting_errors_total", labels) == 2


# -- the config file changing under a running process ------------------------------------------

ORIGINAL = '[sites."sampler.logits"]\ncount_neginf = true\n'


@pytest.mark.parametrize("change", ["switched_off", "malformed", "deleted"])
def test_config_file_changes_after_start_have_no_effect(tmp_path: Path, change: str) -> None:
    path = tmp_path / "guardrails.toml"
    path.write_text(ORIGINAL, encoding="utf-8")
    settings = GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})  # start-up
    if change == "switched_off":
        path.write_text("enabled = false\n", encoding="utf-8")
    elif change == "malformed":
        path.write_text("enabled = = =\n", encoding="utf-8")
    else:
        path.unlink()
    with Guardrails(settings, registry=CollectorRegistry()) as guards:  # use
        x = nan_logits()
        x[1, 7] = -math.inf
        flags = guards.site("sampler.logits")(x)
        assert flags is not None
        assert bool((x[0, :3] == -math.inf).all())
        assert guards.count("sampler.logits", "neginf") == 1  # still the original file's


LAUNCHED = r"""
import json, math, os, pathlib, sys
import torch
import guardrails as gr

path = pathlib.Path(os.environ["GUARDRAILS_CONFIG_FILE"])
if sys.argv[1] == "deleted":
    path.unlink()
else:
    path.write_text("enabled = false\n")
x = torch.zeros(2, 8)
x[0, :3] = math.nan
x[1, 7] = -math.inf
flags = gr.sanitize_logits_(x)
print(json.dumps({"flags": None if flags is None else flags.tolist(),
                  "neginf": gr.default().count("sampler.logits", "neginf")}))
"""


@pytest.mark.parametrize("change", ["deleted", "switched_off"])
def test_launched_process_keeps_the_settings_it_started_with(tmp_path: Path, change: str) -> None:
    path = tmp_path / "guardrails.toml"
    path.write_text(ORIGINAL, encoding="utf-8")
    done = subprocess.run(
        [*LAUNCH, "--config", str(path), "--", sys.executable, "-c", LAUNCHED, change],
        env=base_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert result_line(done.stdout) == {
        "flags": [1, 4],
        "neginf": 1,
    }  # count_neginf: the original file


def test_default_instance_built_after_the_file_is_deleted_names_the_variable(
    tmp_path: Path,
) -> None:
    # Without the launcher, `default()` is built at first use: that is when it reads the file.
    path = tmp_path / "guardrails.toml"
    path.write_text(ORIGINAL, encoding="utf-8")
    done = run_python(LAUNCHED, base_env(GUARDRAILS_CONFIG_FILE=str(path)), args=("deleted",))
    assert done.returncode == 1
    assert "GUARDRAILS_CONFIG_FILE" in done.stderr
    assert "config file does not exist" in done.stderr


# -- an attach target module that fails to import --------------------------------------------

_names = itertools.count()
FAILURES = {
    "missing_dependency": "import guardrails_test_missing_dependency_{n}\n",
    "import_error": "raise ImportError('libfake.so.1: cannot open shared object file')\n",
}
ENGINE_BODY = "class Sampler:\n    def forward(self, logits):\n        return logits.argmax(-1)\n"


@pytest.fixture
def broken_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: Any) -> Iterator[str]:
    n = next(_names)
    name = f"guardrails_broken_engine_{n}"
    failure = FAILURES[request.param].format(n=n)
    (tmp_path / f"{name}.py").write_text(failure + ENGINE_BODY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("broken_engine", list(FAILURES), indirect=True)
def test_failing_target_import_raises_the_hosts_error_and_stays_pending(
    guards: Guardrails, broken_engine: str
) -> None:
    handle = guards.patch(f"{broken_engine}:Sampler.forward", "sampler.logits", tensor="arg:0")
    with pytest.raises(ImportError) as raised:
        importlib.import_module(broken_engine)
    assert type(raised.value) in (ImportError, ModuleNotFoundError)  # not a guardrails error
    assert handle.state == "pending"
    assert handle.error is None
    x = nan_logits()
    assert guards.site("sampler.logits")(x).tolist() == [1, 0]  # the guard itself unaffected
    assert guards.count("sampler.logits", "nan") == 3


@pytest.mark.parametrize("broken_engine", ["import_error"], indirect=True)
def test_target_patch_applies_once_its_module_imports_after_a_failure(
    guards: Guardrails, broken_engine: str, tmp_path: Path
) -> None:
    handle = guards.patch(f"{broken_engine}:Sampler.forward", "sampler.logits", tensor="arg:0")
    with pytest.raises(ImportError):
        importlib.import_module(broken_engine)
    (tmp_path / f"{broken_engine}.py").write_text(ENGINE_BODY, encoding="utf-8")  # fixed
    importlib.invalidate_caches()
    module = importlib.import_module(broken_engine)
    assert handle.state == "applied"
    module.Sampler().forward(nan_logits())
    assert guards.count("sampler.logits", "nan") == 3


LAUNCHED_HOST = r"""
import json, math, sys
import torch
import guardrails as gr

try:
    import {module}
except ImportError as exc:
    outcome = f"host handled {{type(exc).__name__}}"
x = torch.zeros(2, 8)
x[0, :3] = math.nan
flags = gr.sanitize_logits_(x)
print(json.dumps({{"outcome": outcome, "flags": flags.tolist()}}))
"""


@pytest.mark.parametrize("broken_engine", ["missing_dependency"], indirect=True)
def test_launched_host_handles_its_own_import_error_and_stays_guarded(
    tmp_path: Path, broken_engine: str
) -> None:
    config = tmp_path / "guardrails.toml"
    config.write_text(
        f'[[attach]]\nsite = "sampler.logits"\ntarget = "{broken_engine}:Sampler.forward"\n'
        'tensor = "arg:logits"\n',
        encoding="utf-8",
    )
    host = LAUNCHED_HOST.format(module=broken_engine)
    done = subprocess.run(
        [*LAUNCH, "--config", str(config), "--", sys.executable, "-c", host],
        env=base_env(PYTHONPATH=str(tmp_path)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr  # not guardrails' exit 2: the error is the host's
    assert result_line(done.stdout) == {
        "outcome": "host handled ModuleNotFoundError",
        "flags": [1, 0],
    }


@pytest.mark.parametrize("broken_engine", list(FAILURES), indirect=True)
def test_check_reports_a_failing_target_import_as_not_importable_here(broken_engine: str) -> None:
    # `guardrails check` imports targets. A module whose own import fails used to be
    # reported as "module ... not found; wrong version?" when a dependency was missing.
    from guardrails.attach.patching import inspect_point
    from guardrails.attach.points import AttachPoint

    point = AttachPoint.from_arguments(
        site="sampler.logits", target=f"{broken_engine}:Sampler.forward", tensor="arg:0"
    )
    report = inspect_point(point)
    assert report.status == "not_importable"
    assert report.message.startswith(f"importing {broken_engine} failed: ")
    assert "not found" not in report.message
