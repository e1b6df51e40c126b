"""`guardrails config`: effective settings with their sources, in four formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guardrails.cli.main import main
from guardrails.settings import GuardSettings

ROOT = Path(__file__).resolve().parents[2]
FILE = """
sanitize = false
[metrics]
port = 9470
[sites."sampler.logits"]
count_neginf = true
posinf_value = 1e30
dtypes = ["float32"]
abort_on = ["no_valid_token"]
[[attach]]
site = "sampler.logits"
target = "transformers.generation.logits_process:LogitsProcessorList.__call__"
"""


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text(FILE)
    monkeypatch.setenv("GUARDRAILS_CONFIG_FILE", str(path))
    monkeypatch.setenv("GUARDRAILS_LOG_INTERVAL_S", "5")
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["config", *args]) == 0
    return capsys.readouterr().out


def test_table_names_the_source_of_each_value(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = {line.split()[0]: line for line in _run(capsys).splitlines()[1:]}
    assert rows["sanitize"].endswith(f"file {config_file}: sanitize")
    assert rows["reporting.log_interval_s"].endswith("env GUARDRAILS_LOG_INTERVAL_S")
    assert rows["enabled"].endswith("default")
    assert rows['sites."sampler.logits".nan_value'].endswith("default")
    assert "1e+30" in rows['sites."sampler.logits".posinf_value']


def test_toml_output_reproduces_the_effective_settings(
    config_file: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    dumped = tmp_path / "effective.toml"
    dumped.write_text(_run(capsys, "--format", "toml"))
    original = GuardSettings()
    again = GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(dumped)})
    exclude = {"config_file"}
    assert again.model_dump(exclude=exclude) == original.model_dump(exclude=exclude)


def test_toml_output_of_the_example_file_reproduces_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    example = ROOT / "config" / "guardrails.example.toml"
    dumped = tmp_path / "effective.toml"
    dumped.write_text(_run(capsys, "--config", str(example), "--format", "toml"))
    original = GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(example)})
    again = GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(dumped)})
    assert again.model_dump(exclude={"config_file"}) == original.model_dump(exclude={"config_file"})


def test_env_output_reproduces_the_environment_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GUARDRAILS_SITES", "sampler.*,eagle.verify")
    monkeypatch.setenv("GUARDRAILS_METRICS_PORT", "9471")
    lines = [line for line in _run(capsys, "--format", "env").splitlines() if "=" in line]
    environ = dict(line.split("=", 1) for line in lines if not line.startswith("#"))
    assert environ["GUARDRAILS_SITES"] == "sampler.*,eagle.verify"
    assert GuardSettings(environ=environ).model_dump() == GuardSettings().model_dump()


def test_env_output_lists_file_only_keys_as_comments(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(capsys, "--format", "env")
    assert f"# set in {config_file} only" in out
    assert '# sites."sampler.logits".count_neginf = true' in out
    assert '# attach[0].site = "sampler.logits"' in out


def test_json_output_maps_keys_to_value_and_source(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(_run(capsys, "--format", "json"))
    assert data["metrics.port"] == {"value": 9470, "source": f"file {config_file}: metrics.port"}
    assert data['sites."sampler.logits".nan_value']["value"] == "-inf"
    assert data["attach[0].kind"] == {"value": "logits", "source": "default"}


def test_invalid_settings_exit_2_with_the_problem(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GUARDRAILS_REPORT_EVERY", "0")
    assert main(["config"]) == 2
    assert "GUARDRAILS_REPORT_EVERY" in capsys.readouterr().err
