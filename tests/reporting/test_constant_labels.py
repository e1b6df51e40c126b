"""Constant labels (`[metrics.labels]`): every guardrails series carries the engine's own
identifying labels, so that they sit next to the engine's series on its /metrics endpoint."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from guardrails.exceptions import ConfigError
from guardrails.testing import SilentLogger, fresh_guardrails

LABELS = {"model_name": "tiny-llama", "engine": "0"}


def test_every_series_carries_the_constant_labels() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(
        environ={"GUARDRAILS_METRICS_LABELS": "model_name=tiny-llama, engine=0"},
        registry=registry,
        logger=SilentLogger(),
    )
    guards.site("sampler.logits")(torch.tensor([[float("nan"), 1.0]]))
    guards.flush()
    nan = registry.get_sample_value(
        "guardrails_nonfinite_values_total",
        {"site": "sampler.logits", "kind": "nan", "rank": "0", **LABELS},
    )
    calls = registry.get_sample_value(
        "guardrails_guard_calls_total", {"site": "sampler.logits", "rank": "0", **LABELS}
    )
    assert (nan, calls) == (1.0, 1.0)
    names = {
        sample.name: set(sample.labels)
        for family in registry.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert names  # the families exist
    for labels in names.values():
        assert {"model_name", "engine"} <= labels
    guards.close()


def test_a_config_file_table_gives_the_labels(tmp_path: pytest.TempPathFactory) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "g.toml"
    path.write_text('[metrics.labels]\nmodel_name = "m"\ntp_rank = "1"\n', encoding="utf-8")
    guards = fresh_guardrails(environ={"GUARDRAILS_CONFIG_FILE": str(path)})
    assert guards.settings.metrics.labels == {"model_name": "m", "tp_rank": "1"}
    guards.close()


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("site=x", "'site' is a label guardrails sets itself"),
        ("rank=1", "'rank' is a label guardrails sets itself"),
        ("hook=x", "'hook' is a label guardrails sets itself"),
        ("model_name=a,model_name=b", "GUARDRAILS_METRICS_LABELS.*'model_name' is given twice"),
        ("__name__=x", "not a Prometheus label name"),
        ("model-name=x", "not a Prometheus label name"),
        ("model_name", "is not name=value"),
    ],
)
def test_a_bad_label_is_a_settings_error_naming_it(value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        fresh_guardrails(environ={"GUARDRAILS_METRICS_LABELS": value})


def test_every_label_guardrails_sets_is_refused_as_a_constant_label() -> None:
    # A constant label named like one of the families' own would make every increment of
    # those series fail: the refused names are exactly the families' label names.
    from guardrails.reporting.metrics import FAMILIES
    from guardrails.settings.fields import _OWN_LABELS

    assert {label for spec in FAMILIES for label in spec.labels} == _OWN_LABELS


def test_instances_sharing_a_registry_need_the_same_label_names() -> None:
    registry = CollectorRegistry()
    first = fresh_guardrails(registry=registry, metrics={"labels": {"model_name": "a"}})
    second = fresh_guardrails(registry=registry, metrics={"labels": {"model_name": "b"}})
    with pytest.raises(ValueError, match=r"same \[metrics\.labels\] names"):
        fresh_guardrails(registry=registry, metrics={"labels": {"engine": "0"}})
    first.close()
    second.close()
