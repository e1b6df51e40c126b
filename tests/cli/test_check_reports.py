"""`guardrails check` reports every problem in one run, warns about settings that switch
protection off or expose /metrics, and says which guardrails it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardrails.cli.main import main

LP = "transformers.generation.logits_process"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_check_names_the_guardrails_version_and_prints_switches_as_true_false(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    [version] = [line.split() for line in lines if line.startswith("  guardrails ")]
    assert version[1:3] == ["guardrails-logits", "0.1.0"]
    switches = {line.split()[0]: line.split()[1] for line in lines if line.startswith("  ")}
    assert (switches["enabled"], switches["sanitize"], switches["async_assert"]) == (
        "true",
        "true",
        "false",
    )


def test_check_reports_every_problem_of_a_file_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        'sanitize = "flase"\n'
        '[sites."sampler.logits"]\n'
        "posinf_value = 1e38\n"  # overflows float16: used to show only once the rest was fixed
        "[[attach]]\n"
        'site = "sampler.logits"\n'
        f'target = "{LP}:LogitsProcessorList.nope"\n',
    )
    assert main(["check", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if ": error: " in line]
    assert len(errors) == 3, captured.err
    assert f"{path}: sanitize='flase'" in errors[0]
    assert f'{path}: sites."sampler.logits".posinf_value=1e+38' in errors[1]
    assert f"{path}: attach[0].target: {LP}:LogitsProcessorList.nope" in errors[2]
    assert "has no attribute 'nope'" in errors[2]
    assert "FAILED, invalid settings" in captured.err


def test_check_warns_about_a_misspelt_site_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, '[sites."sampler.logit"]\ncount_neginf = true\n')
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    [warning] = [line for line in out.splitlines() if " warning " in line]
    assert f'{path}: sites."sampler.logit"' in warning
    assert "did you mean 'sampler.logits'?" in warning
    assert "1 warning, 0 errors" in out


def test_check_warns_when_every_site_is_disabled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GUARDRAILS_DISABLED_SITES", "*")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "warning  GUARDRAILS_DISABLED_SITES='*': switches every site off" in out


def test_check_warns_when_metrics_are_served_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GUARDRAILS_METRICS_PORT", "9400")
    monkeypatch.setenv("GUARDRAILS_METRICS_ADDR", "0.0.0.0")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "metrics       0.0.0.0:9400" in out
    assert "warning  GUARDRAILS_METRICS_ADDR='0.0.0.0': /metrics is served on 0.0.0.0:9400" in out
