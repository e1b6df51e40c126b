"""`guardrails run -- COMMAND`, run for real: a launcher process, the command, its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RUN = [sys.executable, "-m", "guardrails", "run"]
PY = sys.executable


def launch(
    *command: str, env: dict[str, str] | None = None, config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    options = ["--config", str(config)] if config is not None else []
    return subprocess.run(
        [*RUN, *options, "--", *command],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def write_engine(directory: Path, name: str) -> None:
    (directory / f"{name}.py").write_text(
        "def sample(logits):\n    return logits\n", encoding="utf-8"
    )


def test_exit_status_of_the_command_is_the_launchers(tmp_path: Path) -> None:
    assert launch("sh", "-c", "exit 7").returncode == 7


def test_the_launcher_becomes_the_command(tmp_path: Path) -> None:
    proc = subprocess.Popen([*RUN, "--", "sh", "-c", "echo $$"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=240)
    assert int(out.strip()) == proc.pid  # exec: same process, signals reach the command


def test_a_signal_ends_the_command_as_it_would_alone() -> None:
    proc = launch("sh", "-c", "kill -TERM $$")
    assert proc.returncode == -signal.SIGTERM


def test_bad_settings_stop_the_launch_before_anything_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proc = launch("touch", str(marker), env={"GUARDRAILS_SANITIZE": "maybe"})
    assert proc.returncode == 2
    assert "GUARDRAILS_SANITIZE='maybe'" in proc.stderr
    assert not marker.exists()


def test_a_missing_command_exits_127() -> None:
    proc = launch("guardrails-no-such-command")
    assert proc.returncode == 127
    assert "command not found" in proc.stderr


@pytest.mark.parametrize("case", ["no shebang", "through a file"])
def test_a_command_the_kernel_cannot_execute_exits_126_with_one_line(
    tmp_path: Path, case: str
) -> None:
    """As a shell does (env too): not a traceback and status 1."""
    script = tmp_path / "script"
    script.write_bytes(b"\x00\x01 not a program\n")
    script.chmod(0o755)
    command = str(script) if case == "no shebang" else f"{script}/x"
    proc = launch(command)
    assert proc.returncode == 126
    why = "Exec format error" if case == "no shebang" else "Not a directory"
    assert proc.stderr.strip().splitlines() == [f"guardrails run: {command}: {why}"]


def test_guardrails_is_installed_in_the_command_and_its_python_children() -> None:
    child = (
        "from guardrails.integrations.launcher import installed; "
        "print('child', installed() is not None)"
    )
    parent = (
        "import subprocess, sys\n"
        "from guardrails.integrations.launcher import installed\n"
        "print('parent', installed() is not None, flush=True)\n"
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
    )
    proc = launch(PY, "-c", parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["parent", "True", "child", "True"]


def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("print('theirs', flush=True)\n", encoding="utf-8")
    code = "from guardrails.integrations.launcher import installed; print(installed() is not None)"
    proc = launch(PY, "-c", code, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    # Once for the launcher's own interpreter, once for the command's, then guardrails.
    assert proc.stdout.split() == ["theirs", "theirs", "True"]


def test_a_config_error_inside_a_child_fails_loudly() -> None:
    # The launcher saw valid settings; the command changes them for its own child.
    proc = launch("env", "GUARDRAILS_SANITIZE=maybe", PY, "-c", "print('ran')")
    assert proc.returncode == 2
    assert "GUARDRAILS_SANITIZE='maybe'" in proc.stderr
    assert "Error in sitecustomize" not in proc.stderr
    assert "ran" not in proc.stdout


def test_a_pending_attach_point_applies_when_the_child_imports_its_module(
    tmp_path: Path,
) -> None:
    write_engine(tmp_path, "launched_engine")
    config = tmp_path / "guardrails.toml"
    config.write_text(
        '[[attach]]\nsite = "sampler.logits"\ntarget = "launched_engine:sample"\n'
        'tensor = "arg:logits"\n',
        encoding="utf-8",
    )
    code = (
        "import torch\n"
        "from guardrails.integrations.launcher import installed\n"
        "states = [h.state for h in installed().patches()]\n"
        "import launched_engine\n"
        "out = launched_engine.sample(torch.tensor([[float('nan'), 1.0]]))\n"
        "print(states, [h.state for h in installed().patches()], out.tolist(),\n"
        "      installed().count('sampler.logits', 'nan'))\n"
    )
    proc = launch(PY, "-c", code, env={"PYTHONPATH": str(tmp_path)}, config=config)
    assert proc.returncode == 0, proc.stderr
    assert "['pending'] ['applied'] [[-inf, 1.0]] 1" in proc.stdout


def _two_points(tmp_path: Path) -> Path:
    """A config whose first point does not fit its target and whose second does."""
    write_engine(tmp_path, "launched_engine")
    config = tmp_path / "guardrails.toml"
    config.write_text(
        '[[attach]]\nsite = "sampler.logits"\ntarget = "launched_engine:sample"\n'
        'tensor = "arg:hidden"\n\n'
        '[[attach]]\nsite = "model.logits"\ntarget = "launched_engine:sample"\n'
        'tensor = "arg:logits"\n',
        encoding="utf-8",
    )
    return config


# The engine imports its module, samples once, and prints what guardrails saw.
_ENGINE_RUN = (
    "import torch, launched_engine\n"
    "from guardrails.integrations.launcher import installed\n"
    "out = launched_engine.sample(torch.tensor([[float('nan'), 1.0]]))\n"
    "guards = installed()\n"
    "print('carried on', [h.state for h in guards.patches()], out.tolist())\n"
    "print(guards.attach_errors.failures[0][:2])\n"
    "from prometheus_client import REGISTRY\n"
    "print(REGISTRY.get_sample_value('guardrails_attach_errors_total',\n"
    "    {'site': 'sampler.logits', 'target': 'launched_engine:sample', 'rank': '0'}))\n"
)


def test_an_attach_point_that_does_not_fit_never_stops_the_server(tmp_path: Path) -> None:
    config = _two_points(tmp_path)
    proc = launch(PY, "-c", _ENGINE_RUN, env={"PYTHONPATH": str(tmp_path)}, config=config)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # The point that fits still guards: the NaN was healed to -inf.
    assert lines[0] == "carried on ['failed', 'applied'] [[-inf, 1.0]]"
    assert lines[1] == "('sampler.logits', 'launched_engine:sample')"
    assert lines[2] == "1.0"  # guardrails_attach_errors_total
    assert "guardrails.attach_error" in proc.stderr
    assert "has no argument 'hidden'" in proc.stderr


def test_strict_attach_stops_the_child_at_import(tmp_path: Path) -> None:
    config = _two_points(tmp_path)
    # Even an import wrapped in `except Exception` cannot swallow it.
    code = "try:\n    import launched_engine\nexcept Exception:\n    pass\nprint('carried on')\n"
    env = {"PYTHONPATH": str(tmp_path), "GUARDRAILS_STRICT_ATTACH": "true"}
    proc = launch(PY, "-c", code, env=env, config=config)
    assert proc.returncode == 2
    assert f"{config}: attach[0].target='launched_engine:sample'" in proc.stderr
    assert "has no argument 'hidden'" in proc.stderr
    assert "carried on" not in proc.stdout


def test_the_config_option_is_the_commands_config_file(tmp_path: Path) -> None:
    config = tmp_path / "guardrails.toml"
    config.write_text("sanitize = false\n", encoding="utf-8")
    code = (
        "from guardrails.integrations.launcher import installed\n"
        "print(installed().settings.sanitize)\n"
    )
    proc = launch(PY, "-c", code, config=config)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]


def test_a_missing_config_file_stops_the_launch(tmp_path: Path) -> None:
    proc = launch("true", config=tmp_path / "missing.toml")
    assert proc.returncode == 2
    assert "config file does not exist" in proc.stderr


def _liveness_profile(tmp_path: Path, sampler: str) -> Path:
    """An engine with two samplers, only `sample` called by `step`; the profile puts the
    site on `sampler` and the heartbeat on `step`."""
    (tmp_path / "lively_engine.py").write_text(
        "def sample(logits):\n    return logits\n\n"
        "def old_sample(logits):\n    return logits\n\n"
        "def step(logits):\n    return sample(logits)\n",
        encoding="utf-8",
    )
    config = tmp_path / "profile.toml"
    config.write_text(
        'heartbeat = "lively_engine:step"\nliveness_steps = 16\n\n'
        f'[[attach]]\nsite = "sampler.logits"\ntarget = "lively_engine:{sampler}"\n'
        'tensor = "arg:logits"\n',
        encoding="utf-8",
    )
    return config


_LIVELY_RUN = (
    "import torch, lively_engine\n"
    "for _ in range(40):\n"
    "    lively_engine.step(torch.zeros(2, 8))\n"
    "from prometheus_client import REGISTRY\n"
    "print(REGISTRY.get_sample_value('guardrails_site_not_called',\n"
    "    {'site': 'sampler.logits', 'rank': '0'}))\n"
)


def test_under_run_a_site_nobody_calls_is_reported(tmp_path: Path) -> None:
    config = _liveness_profile(tmp_path, "old_sample")
    proc = launch(PY, "-c", _LIVELY_RUN, env={"PYTHONPATH": str(tmp_path)}, config=config)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1.0"]
    # Through the host's logging (stdlib's last resort, stderr): once, naming the target.
    assert proc.stderr.count("guardrails.site_not_called") == 1
    assert "site=sampler.logits" in proc.stderr
    assert "lively_engine:old_sample" in proc.stderr


def test_under_run_a_site_on_the_path_is_not_reported(tmp_path: Path) -> None:
    config = _liveness_profile(tmp_path, "sample")
    proc = launch(PY, "-c", _LIVELY_RUN, env={"PYTHONPATH": str(tmp_path)}, config=config)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0.0"]
    assert "guardrails.site_not_called" not in proc.stderr
