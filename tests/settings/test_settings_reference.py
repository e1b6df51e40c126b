"""The generated settings reference matches the code (run `make docs` when this fails)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from guardrails.settings import (
    AttachSettings,
    GuardSettings,
    MetricsSettings,
    ReportingSettings,
    SiteSettings,
)
from guardrails.settings.docs import (
    ENV_TABLE_BEGIN,
    ENV_TABLE_END,
    ENV_TABLE_FILE,
    REFERENCE_FILE,
    env_table,
    settings_reference,
)

ROOT = Path(__file__).resolve().parents[2]
STALE = "stale: run `make docs` (python -m guardrails.settings.docs --write) and commit the result"


def test_configuration_environment_table_is_current() -> None:
    assert ENV_TABLE_FILE == ROOT / "docs" / "configuration.md"
    text = ENV_TABLE_FILE.read_text(encoding="utf-8")
    block = text[text.index(ENV_TABLE_BEGIN) + len(ENV_TABLE_BEGIN) : text.index(ENV_TABLE_END)]
    assert block.strip("\n") == env_table().strip("\n"), STALE


def test_settings_reference_is_current() -> None:
    assert REFERENCE_FILE == ROOT / "docs" / "settings.md"
    assert REFERENCE_FILE.read_text(encoding="utf-8") == settings_reference(), STALE


@pytest.mark.parametrize(
    "model", [GuardSettings, ReportingSettings, MetricsSettings, SiteSettings, AttachSettings]
)
def test_every_setting_says_what_it_means_and_accepts(model: type[BaseModel]) -> None:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            continue  # a nested table, documented field by field
        if name in ("sites", "attach"):
            continue
        assert info.description, f"{model.__name__}.{name} has no description"
        extra = info.json_schema_extra
        assert isinstance(extra, dict), f"{model.__name__}.{name}"
        assert extra.get("accepted"), f"{model.__name__}.{name} does not say what it accepts"


def test_reference_mentions_every_environment_variable() -> None:
    from guardrails.settings import ENV_VARS

    reference = settings_reference() + env_table()
    for name in ENV_VARS:
        assert f"`{name}`" in reference
