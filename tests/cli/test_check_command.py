"""`guardrails check`: the environment, the settings and every attach target, checked in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardrails.cli.main import main

PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"
LP = "transformers.generation.logits_process"


def config(tmp_path: Path, *entries: str) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text("".join(f"[[attach]]\n{entry}\n" for entry in entries), encoding="utf-8")
    return path


def entry(target: str, tensor: str = "return") -> str:
    return f'site = "sampler.logits"\ntarget = "{target}"\ntensor = "{tensor}"\n'


def test_a_resolvable_profile_passes_with_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--config", str(PROFILES / "transformers.toml")]) == 0
    out = capsys.readouterr().out
    assert "ok       sampler.logits <- " in out
    assert "guardrails check: ok (1 attach point, 1 resolved" in out


def test_targets_of_an_engine_not_installed_here_are_warnings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--config", str(PROFILES / "sglang.toml")]) == 0
    out = capsys.readouterr().out
    assert "warning  sampler.logits <- sglang.srt.layers.sampler" in out
    assert "sglang is not installed here" in out


def test_strict_makes_targets_not_importable_here_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--strict", "--config", str(PROFILES / "vllm.toml")]) == 1
    assert "vllm is not installed here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "tensor", "expected"),
    [
        (f"{LP}:LogitsProcessorList.nope", "return", "has no attribute 'nope'"),
        (f"{LP}:LogitsProcessorList.__call__", "arg:logits", "has no argument 'logits'"),
        (f"{LP}:LogitsProcessorList.__call__", "arg:3", "arg:3 is out of range"),
        ("string:ascii_letters", "return", "is not callable"),
        ("transformers.generation.no_such_module:f", "return", "no_such_module not found"),
    ],
)
def test_a_target_that_does_not_fit_fails_with_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, tensor: str, expected: str
) -> None:
    path = config(tmp_path, entry(f"{LP}:LogitsProcessorList.__call__"), entry(target, tensor))
    assert main(["check", "--config", str(path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1
    assert f"{path}: attach[1].target: {target}: " in errors[0]
    assert expected in errors[0]


def test_invalid_settings_exit_2_with_the_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, entry("not-an-import-path"))
    assert main(["check", "--config", str(path)]) == 2
    assert "attach[0].target='not-an-import-path'" in capsys.readouterr().err


def test_a_config_without_attach_points_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "guardrails.toml"
    path.write_text("sanitize = true\n", encoding="utf-8")
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    assert "guardrails check: ok (0 attach points" in out


def test_points_for_other_versions_are_listed_as_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One profile, two versions of the same engine: the point for the installed version is
    # checked, the other is skipped, not an error, even under --strict.
    path = config(
        tmp_path,
        entry(f"{LP}:LogitsProcessorList.__call__") + 'when = "transformers>=4.0"\n',
        entry(f"{LP}:LogitsProcessorList.gone") + 'when = "transformers<4.0"\n',
    )
    assert main(["check", "--strict", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped  sampler.logits <- transformers.generation.logits_process:" in out
    assert "for transformers<4.0; " in out
    assert "(2 attach points, 1 resolved, 0 not importable here, 1 for other versions" in out
