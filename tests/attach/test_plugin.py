"""guardrails as vLLM's and SGLang's general plugin, in real processes: the entry points this
distribution registers, loaded the way each engine loads its group (`ENGINE_LOADER`: the same
`importlib.metadata.entry_points(group=...)` walk and allowlist rule as vLLM 0.32-0.34's
`load_plugins_by_group` and SGLang 0.5.23's `load_plugins`), then a guarded call of a module
the configuration attaches to. The real engines' servers, started plainly, are
tests/e2e/vllm and tests/e2e/sglang."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from guardrails.integrations import plugin
from tests.processes import ROOT, child_env, json_events, run_python

# What each engine does with its group in every process it starts: vLLM loads every entry
# when VLLM_PLUGINS is unset and only the names it lists otherwise ("" lists none); SGLang
# loads every entry when SGLANG_PLUGINS is empty or unset. The loader is called twice, as a
# plugin may be (vLLM's docs ask plugins to be idempotent).
ENGINE_LOADER = """
import os, sys
from importlib.metadata import entry_points
engine = sys.argv[1]
group, allow_var = {"vllm": ("vllm.general_plugins", "VLLM_PLUGINS"),
                    "sglang": ("sglang.srt.plugins", "SGLANG_PLUGINS")}[engine]
raw = os.environ.get(allow_var)
if engine == "vllm":
    allowed = None if raw is None else raw.split(",")
else:
    allowed = {x.strip() for x in raw.split(",") if x.strip()} if raw else None
for _ in range(2):
    for ep in entry_points(group=group):
        if allowed is None or ep.name in allowed:
            ep.load()()
from guardrails.integrations import launcher
import torch
import toyengine
guards = launcher.installed()
out = toyengine.sample(torch.tensor([[float("nan"), 1.0]]))
print("RESULT", {"installed": guards is not None,
                 "healed": not bool(torch.isnan(out).any()),  # NaN -> -inf: never sampled
                 "metrics_dir": os.environ.get("GUARDRAILS_METRICS_DIR"),
                 "config_file": os.environ.get("GUARDRAILS_CONFIG_FILE")})
if guards is not None:
    guards.flush()
"""
TOY_ENGINE = "def sample(logits):\n    return logits\n"
TOY_CONFIG = """
[[attach]]
site = "sampler.logits"
target = "toyengine:sample"
tensor = "arg:logits"
"""


def run_engine(
    tmp_path: Path, engine: str, *prefix: str, **env: str
) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """The toy engine's process: (its RESULT line, its guardrails events, the process)."""
    (tmp_path / "toyengine.py").write_text(TOY_ENGINE, encoding="utf-8")
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_LOADER, encoding="utf-8")
    path = os.pathsep.join([str(tmp_path), str(ROOT)])
    environ = child_env(PYTHONPATH=path, GUARDRAILS_LOG_FORMAT="json", **env)
    for var in ("VLLM_PLUGINS", "SGLANG_PLUGINS"):
        if var not in env:
            environ.pop(var, None)
    proc = run_python(*prefix, str(script), engine, env=environ)
    result: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = eval(line[len("RESULT ") :])  # a dict literal this test printed
    return result, json_events(proc.stderr), proc


def started(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event["event"] == "guardrails.started"]


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "toy.toml"
    config.write_text(TOY_CONFIG, encoding="utf-8")
    return config


@pytest.mark.parametrize("engine", plugin.ENGINES)
def test_the_distribution_registers_one_entry_per_engine_group(engine: str) -> None:
    from importlib.metadata import entry_points

    group, _ = plugin.ENTRY_POINTS[engine]
    (entry,) = [ep for ep in entry_points(group=group) if ep.name == plugin.ENTRY_NAME]
    assert entry.value == f"guardrails.integrations.plugin:{engine}"
    assert entry.load() is getattr(plugin, engine)


@pytest.mark.parametrize("engine", plugin.ENGINES)
def test_with_no_configuration_the_engines_shipped_profile_is_installed_once(
    tmp_path: Path, engine: str
) -> None:
    result, events, proc = run_engine(tmp_path, engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (event,) = started(events)  # the loader ran twice: installed once
    assert event["installed_by"] == f"plugin:{engine}"
    assert event["pid"] > 0
    assert event["config_file"] == str(plugin.profile(engine))
    assert event["hooks"] == {"vllm": ["vllm.end_poisoned_requests"]}.get(
        engine, ["sglang.abort_poisoned_requests"]
    )
    assert result["installed"] is True
    assert result["config_file"] == str(plugin.profile(engine))
    # The tree's metrics directory, made and exported for the processes the engine starts,
    # is removed when the process that made it exits.
    directory = result["metrics_dir"]
    assert directory
    assert Path(directory).name.startswith("guardrails-metrics-")
    assert not Path(directory).exists()


def test_the_config_file_named_is_used_and_guards_the_engines_call(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    relative = os.path.relpath(config, ROOT)  # the engine's process starts in ROOT
    result, events, proc = run_engine(tmp_path, "vllm", GUARDRAILS_CONFIG_FILE=relative)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["healed"] is True  # the NaN was healed in place by the attach point
    # Made absolute, for the processes the engine starts in other directories.
    assert Path(result["config_file"]).is_absolute()
    assert Path(result["config_file"]).resolve() == config.resolve()
    (event,) = started(events)
    assert event["config_file"] == result["config_file"]
    nonfinite = [e for e in events if e["event"] == "guardrails.nonfinite_logits"]
    assert [e["nan"] for e in nonfinite] == [1]


def test_unplugged_the_same_call_is_not_guarded(tmp_path: Path) -> None:
    # The control: the engine's allowlist names no plugin.
    config = write_config(tmp_path)
    result, events, proc = run_engine(
        tmp_path, "vllm", GUARDRAILS_CONFIG_FILE=str(config), VLLM_PLUGINS=""
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (result["installed"], result["healed"], events) == (False, False, [])


@pytest.mark.parametrize(
    ("engine", "allowlist"),
    [("vllm", {"VLLM_PLUGINS": "other"}), ("sglang", {"SGLANG_PLUGINS": "other"})],
)
def test_the_engines_allowlist_without_guardrails_leaves_it_out(
    tmp_path: Path, engine: str, allowlist: dict[str, str]
) -> None:
    config = write_config(tmp_path)
    config_file = str(config)
    result, events, proc = run_engine(
        tmp_path, engine, GUARDRAILS_CONFIG_FILE=config_file, **allowlist
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (result["installed"], result["healed"], started(events)) == (False, False, [])


def test_an_allowlist_naming_guardrails_installs_it(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result, _, proc = run_engine(
        tmp_path, "sglang", GUARDRAILS_CONFIG_FILE=str(config), SGLANG_PLUGINS="x, guardrails"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (result["installed"], result["healed"]) == (True, True)


def test_guardrails_enabled_false_guards_nothing_and_makes_no_directory(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result, events, proc = run_engine(
        tmp_path, "vllm", GUARDRAILS_CONFIG_FILE=str(config), GUARDRAILS_ENABLED="false"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (result["healed"], result["metrics_dir"]) == (False, None)
    (event,) = started(events)
    assert (event["enabled"], event["installed_by"]) == (False, "plugin:vllm")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GUARDRAILS_ENABLED": "maybe"}, "GUARDRAILS_ENABLED"),
        ({"GUARDRAILS_CONFIG_FILE": "/nonexistent/guardrails.toml"}, "guardrails.toml"),
    ],
    ids=["bad-env-value", "missing-config-file"],
)
def test_a_bad_configuration_ends_the_engines_process_with_status_2(
    tmp_path: Path, env: dict[str, str], named: str
) -> None:
    result, _, proc = run_engine(tmp_path, "vllm", **env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert named in proc.stderr
    assert "guardrails: exiting (status 2)" in proc.stderr
    assert result == {}  # the engine never got past its plugins


def test_under_guardrails_run_the_plugin_finds_it_installed(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result, events, proc = run_engine(
        tmp_path,
        "vllm",
        "-m",
        "guardrails",
        "run",
        "--config",
        str(config),
        "--",
        sys.executable,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (result["installed"], result["healed"]) == (True, True)
    (event,) = started(events)  # the launcher's bootstrap; the plugin added nothing
    assert event["installed_by"] == "launcher"


def test_a_forked_child_keeps_its_parents_install(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    script = textwrap.dedent(
        """
        import os, sys
        from guardrails.integrations import launcher, plugin
        plugin.vllm()
        parent = launcher.installed()
        pid = os.fork()
        if pid == 0:
            plugin.vllm()  # the engine core / a worker loading its plugins again
            os._exit(0 if launcher.installed() is parent else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    env = child_env(
        PYTHONPATH=str(ROOT), GUARDRAILS_LOG_FORMAT="json", GUARDRAILS_CONFIG_FILE=str(config)
    )
    proc = run_python("-c", script, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count('"guardrails.started"') == 1


def test_an_unknown_profile_is_a_config_error_naming_the_shipped_ones() -> None:
    from guardrails.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r"profile='tgi': no shipped profile of that name.*vllm"):
        plugin.profile("tgi")
    assert plugin.profile("sglang").is_file()
