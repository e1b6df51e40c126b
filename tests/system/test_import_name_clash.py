"""Another distribution installing the import name `guardrails` (the popular `guardrails-ai`
does) is found and reported, by `guardrails check` and by the start-up event, with what to do.

The other distribution is real installed metadata: a `*.dist-info` directory on the child
process's path, as pip leaves it, naming `guardrails` as its top-level package.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from guardrails.cli.main import main
from tests.processes import ROOT, child_env, run_python


def install_metadata(site: Path, name: str, version: str = "0.6.0") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    (info / "top_level.txt").write_text("guardrails\n", encoding="utf-8")
    (info / "RECORD").write_text(
        "guardrails/__init__.py,,\nguardrails/cli/__init__.py,,\n", encoding="utf-8"
    )


def run(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return run_python(*argv, env=env)


@pytest.mark.parametrize("other", ["guardrails-ai", "guardrails-fork"])
def test_check_warns_when_another_distribution_owns_the_import_name(
    tmp_path: Path, other: str
) -> None:
    install_metadata(tmp_path / "site", other)
    done = run(tmp_path / "site", "-m", "guardrails", "check")
    assert done.returncode == 0, done.stderr
    [warning] = [line for line in done.stdout.splitlines() if " warning  " in line]
    assert f"the import name 'guardrails' is also installed by {other}" in warning
    assert f"pip uninstall {other} guardrails-logits" in warning


def test_check_has_no_install_warning_without_another_distribution(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check"]) == 0
    assert "also installed by" not in capsys.readouterr().out


STARTED = r"""
import guardrails as gr
gr.Guardrails(gr.GuardSettings()).close()
"""


def test_the_start_up_event_warns_about_guardrails_ai(tmp_path: Path) -> None:
    install_metadata(tmp_path / "site", "guardrails-ai")
    done = run(tmp_path / "site", "-c", STARTED)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    [line] = [line for line in done.stderr.splitlines() if line.startswith("guardrails.started")]
    assert "the import name 'guardrails' is also installed by guardrails-ai" in line


def test_the_command_is_also_installed_as_guardrails_logits() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"
    ]
    assert scripts["guardrails-logits"] == scripts["guardrails"] == "guardrails.cli.main:main"


def test_version_prints_the_distribution_and_its_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "guardrails-logits 0.1.0"
