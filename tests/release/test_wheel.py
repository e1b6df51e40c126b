"""The release as a user gets it: the built sdist and wheel (RELEASE_DIST) and a fresh venv with
only the wheel installed in it (RELEASE_VENV), driven by subprocess from a directory outside
the repository, so nothing comes from the source tree. `make release` builds both and runs
this module (.ci/release/run.sh); `make test` does not collect it."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
PROFILES = sorted(p.name for p in (ROOT / "guardrails" / "profiles").glob("*.toml"))
ENTRY_POINTS = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}


def _from_env(name: str) -> Path:
    value = os.environ.get(name, "").strip()
    if not value:
        pytest.fail(f"{name} is not set: tests/release runs under `make release`", pytrace=False)
    return Path(value).resolve()


@pytest.fixture(scope="module")
def venv() -> Path:
    path = _from_env("RELEASE_VENV")
    if not os.access(path / "bin" / "python", os.X_OK):
        pytest.fail(f"RELEASE_VENV={path} has no bin/python", pytrace=False)
    return path


@pytest.fixture(scope="module")
def wheel() -> Path:
    return _one(_from_env("RELEASE_DIST"), f"guardrails_logits-{VERSION}-py3-none-any.whl")


@pytest.fixture(scope="module")
def sdist() -> Path:
    return _one(_from_env("RELEASE_DIST"), f"guardrails_logits-{VERSION}.tar.gz")


def _one(dist: Path, name: str) -> Path:
    found = sorted(p.name for p in dist.iterdir()) if dist.is_dir() else []
    if name not in found:
        pytest.fail(f"RELEASE_DIST={dist} has no {name} (it has {found})", pytrace=False)
    return dist / name


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory of every command: `python -c` puts it first on sys.path."""
    return tmp_path_factory.mktemp("outside-the-repository")


def run(command: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `command` in `cwd` with no PYTHONPATH; a non-zero status fails with its output."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (
        f"{command} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done


def python(venv: Path, code: str, cwd: Path, **env: str) -> str:
    return run([venv / "bin" / "python", "-c", code], cwd, **env).stdout


@pytest.fixture(scope="module")
def site_packages(venv: Path, outside: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(python(venv, code, outside).strip()).resolve()


def test_the_wheel_ships_the_profiles_the_type_marker_and_the_entry_points(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        shipped = {n: archive.read(n) for n in names if n.startswith("guardrails/profiles/")}
        entry_points = archive.read(f"guardrails_logits-{VERSION}.dist-info/entry_points.txt")
        metadata = archive.read(f"guardrails_logits-{VERSION}.dist-info/METADATA")
    assert sorted(shipped) == [f"guardrails/profiles/{name}" for name in PROFILES]
    assert {f"{e}.toml" for e in ("vllm", "sglang", "transformers", "transformers-serve")} <= set(
        PROFILES
    )
    for name in PROFILES:
        repo = (ROOT / "guardrails" / "profiles" / name).read_bytes()
        assert shipped[f"guardrails/profiles/{name}"] == repo, f"{name} differs from the repo's"
    assert "guardrails/py.typed" in names
    assert f"Version: {VERSION}\n" in metadata.decode()
    groups = configparser.ConfigParser(delimiters=("=",))
    groups.read_string(entry_points.decode())
    assert dict(groups["vllm.general_plugins"]) == {
        "guardrails": "guardrails.integrations.plugin:vllm"
    }
    assert dict(groups["sglang.srt.plugins"]) == {
        "guardrails": "guardrails.integrations.plugin:sglang"
    }
    assert dict(groups["console_scripts"]) == {
        "guardrails": "guardrails.cli.main:main",
        "guardrails-logits": "guardrails.cli.main:main",
    }


def test_the_sdist_ships_the_profiles_as_files(sdist: Path) -> None:
    top = f"guardrails_logits-{VERSION}"
    with tarfile.open(sdist) as archive:
        members = {m.name: m for m in archive.getmembers()}
        for name in PROFILES:
            member = members.get(f"{top}/guardrails/profiles/{name}")
            assert member is not None, f"the sdist lacks guardrails/profiles/{name}"
            # config/profiles is a symlink in the repository; the sdist carries real files.
            assert member.isfile()
            extracted = archive.extractfile(member)
            assert extracted is not None
            assert extracted.read() == (ROOT / "guardrails" / "profiles" / name).read_bytes()
    for name in ("guardrails/py.typed", "pyproject.toml", "README.md"):
        assert f"{top}/{name}" in members


def test_the_venv_imports_the_installed_wheel_not_the_source_tree(
    venv: Path, wheel: Path, outside: Path, site_packages: Path
) -> None:
    code = (
        "import importlib.metadata, json, guardrails\n"
        "dist = importlib.metadata.distribution('guardrails-logits')\n"
        "print(json.dumps({'file': guardrails.__file__, 'version': guardrails.__version__,"
        " 'metadata': dist.version, 'direct_url': dist.read_text('direct_url.json')}))"
    )
    found = json.loads(python(venv, code, outside))
    assert Path(found["file"]).resolve().is_relative_to(site_packages)
    assert found["version"] == found["metadata"] == VERSION
    origin = json.loads(found["direct_url"])
    assert origin["url"].endswith(f"/{wheel.name}")
    assert "dir_info" not in origin  # a wheel file, never an (editable) directory


def test_the_installed_command_names_this_release(venv: Path, outside: Path) -> None:
    out = run([venv / "bin" / "guardrails-logits", "--version"], outside).stdout
    assert out.strip() == f"guardrails-logits {VERSION}"


def test_the_wheels_requirements_hold_in_the_venv(venv: Path, outside: Path) -> None:
    out = run([venv / "bin" / "python", "-m", "pip", "check"], outside).stdout
    assert "No broken requirements found" in out


def test_demo_serves_the_clean_requests_and_aborts_the_poisoned_ones(
    venv: Path, outside: Path
) -> None:
    done = run([venv / "bin" / "guardrails", "demo"], outside)
    out = done.stdout + done.stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, out, re.MULTILINE)
        assert found, f"no {pattern!r} in the demo's output:\n{out}"
        return int(found[1])

    served = number(r"^serving (\d+) requests, .*guardrails ON$")
    finished = number(r"^requests finished\s+(\d+)$")
    aborted = number(r"^requests aborted \(flagged rows\)\s+(\d+)$")
    assert finished > 0
    assert aborted > 0
    assert finished + aborted == served
    assert re.search(r"^sampler\.logits\s+nan\s+[1-9]\d*$", out, re.MULTILINE), out


@pytest.mark.parametrize("engine", ["vllm", "sglang", "transformers", "transformers-serve"])
def test_check_passes_on_each_shipped_profile_from_the_venv(
    engine: str, venv: Path, outside: Path, site_packages: Path
) -> None:
    code = f"from guardrails.integrations.plugin import profile; print(profile({engine!r}))"
    config = Path(python(venv, code, outside).strip())
    assert config.resolve().is_relative_to(site_packages)
    out = run([venv / "bin" / "guardrails", "check", "--config", config], outside).stdout
    lines = out.splitlines()
    assert lines[-1].startswith("guardrails check: ok"), out
    [here] = [line for line in lines if line.startswith("  guardrails ")]
    assert f"guardrails-logits {VERSION} ({site_packages}" in here


@pytest.mark.parametrize("engine", sorted(ENTRY_POINTS))
def test_the_engines_plugin_entry_point_starts_guardrails_with_the_shipped_profile(
    engine: str, venv: Path, outside: Path, site_packages: Path
) -> None:
    # What the engine does in each process it starts: find its group's entries, load, call.
    code = (
        "import importlib.metadata, json, os\n"
        f"entries = importlib.metadata.entry_points(group={ENTRY_POINTS[engine]!r})\n"
        "print(json.dumps({'names': sorted(e.name for e in entries), 'pid': os.getpid()}),"
        " flush=True)\n"
        "entries['guardrails'].load()()\n"
    )
    done = run([venv / "bin" / "python", "-c", code], outside, GUARDRAILS_LOG_FORMAT="json")
    child = json.loads(done.stdout.splitlines()[0])
    assert "guardrails" in child["names"]
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    [started] = [e for e in events if e["event"] == "guardrails.started"]
    assert started["installed_by"] == f"plugin:{engine}"
    assert started["pid"] == child["pid"]
    config = Path(started["config_file"]).resolve()
    assert config.is_relative_to(site_packages)
    assert config.name == f"{engine}.toml"
