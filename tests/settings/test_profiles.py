"""The engine profiles in config/profiles/: each is a valid config file of attach points."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from guardrails import GuardSettings
from guardrails.attach.patching import inspect_point
from guardrails.attach.points import AttachPoint
from guardrails.settings.targets import parse_target

PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"
ALL = sorted(PROFILES.glob("*.toml"))


def settings_of(path: Path) -> GuardSettings:
    return GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_the_engine_profiles_exist() -> None:
    assert [p.stem for p in ALL] == ["sglang", "transformers-serve", "transformers", "vllm"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_a_profile_parses_as_a_config_file_with_attach_points(path: Path) -> None:
    assert settings_of(path).attach


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_every_target_names_a_module_path_of_its_engine_and_a_qualified_name(path: Path) -> None:
    for entry in settings_of(path).attach:
        target = parse_target(entry.target)
        assert target.module.split(".")[0] == path.stem.split("-")[0]  # transformers-serve
        assert len(target.module.split(".")) >= 2
        assert target.qualname


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_a_profile_says_what_it_was_checked_against(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    checked = re.search(r"^# Checked .*against", text, re.MULTILINE)
    assert checked is not None
    assert re.search(r"@[0-9a-f]{40}\b|transformers \d+\.\d+\.\d+", text)
    for entry in settings_of(path).attach:
        name = entry.target.rsplit(".", 1)[-1].split(":")[-1]
        assert f"def {name}(" in text  # the signature checked is written down


@pytest.mark.parametrize(
    ("stem", "sites"),
    [
        ("sglang", {"sampler.logits", "eagle.verify", "sampler.token_ids"}),
        ("vllm", {"sampler.logits", "sampler.token_ids"}),
        ("transformers", {"sampler.logits"}),
        ("transformers-serve", {"sampler.logits"}),
    ],
)
def test_a_profile_guards_its_engines_sampling_sites(stem: str, sites: set[str]) -> None:
    declared = {entry.site for entry in settings_of(PROFILES / f"{stem}.toml").attach}
    assert sites <= declared


@pytest.mark.parametrize("stem", ["transformers", "transformers-serve"])
def test_the_transformers_profiles_resolve_against_the_installed_transformers(stem: str) -> None:
    pytest.importorskip("transformers")
    for entry in settings_of(PROFILES / f"{stem}.toml").attach:
        report = inspect_point(AttachPoint.from_settings(entry))
        assert report.status == "ok", report.message


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_every_profile_names_a_heartbeat_of_its_engine(path: Path) -> None:
    # The liveness self-check: without one an attach point nobody calls would be silent.
    heartbeat = settings_of(path).heartbeat
    assert heartbeat
    for text in heartbeat:
        assert parse_target(text).module.split(".")[0] == path.stem.split("-")[0]
    assert not [n for n in settings_of(path).notices if "heartbeat" in str(n)]
