"""deploy/kubernetes: objects prometheus-operator and the library both accept, and that agree.

The PodMonitor, the PrometheusRule and the example pod's containers and volumes are validated
against the prometheus-operator models (cloudcoil-models-prometheus-operator). Those models
ignore keys they do not know, so each object is also round-tripped and compared with its
input: a key the schema does not have (a typo, a wrong nesting) shows up as dropped. The
PrometheusRule must carry exactly the groups of deploy/prometheus/guardrails.rules.yml; the
example pod's settings must be accepted by `GuardSettings`, and its labels, port and volumes
must match what the PodMonitor and the environment variables refer to.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from cloudcoil.apimachinery import ObjectMeta
from cloudcoil.models.prometheus_operator import v1

from guardrails.settings import ENV_VARS, GuardSettings
from tests.deploy.promql import RULES

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
PODMONITOR = KUBE / "podmonitor.yaml"
PROMETHEUSRULE = KUBE / "prometheusrule.yaml"
EXAMPLE = KUBE / "example-deployment.yaml"
RENDER = KUBE / "render_prometheusrule.py"

# Variables the example pod may set besides GUARDRAILS_* ones.
OTHER_ENV = frozenset({"PROMETHEUS_MULTIPROC_DIR"})
# Kubernetes IANA_SVC_NAME: what a named container port must be.
PORT_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _one(path: Path) -> dict[str, Any]:
    (doc,) = _documents(path)
    return doc


def _of_kind(kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in _documents(EXAMPLE) if doc["kind"] == kind]
    return doc


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _of_kind("Deployment")["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    (container,) = _pod_spec()["containers"]
    return dict(container)


def _env() -> dict[str, str]:
    return {item["name"]: item["value"] for item in _container()["env"]}


def differences(given: Any, kept: Any, path: str = "") -> Iterator[str]:
    """Where `kept` (a model's dump) lost or changed something of `given` (its input)."""
    if isinstance(given, dict) and isinstance(kept, dict):
        for key, value in given.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in kept:
                yield f"{where}: unknown key (dropped by the schema)"
            else:
                yield from differences(value, kept[key], where)
    elif isinstance(given, list) and isinstance(kept, list) and len(given) == len(kept):
        for n, (a, b) in enumerate(zip(given, kept, strict=True)):
            yield from differences(a, b, f"{path}[{n}]")
    elif given != kept:
        yield f"{path}: {given!r} became {kept!r}"


def validate(model: type[pydantic.BaseModel], data: dict[str, Any], what: str) -> None:
    """`data` is valid for `model` and the model keeps every key of it."""
    try:
        parsed = model.model_validate(data)
    except pydantic.ValidationError as exc:
        pytest.fail(f"{what} is not a valid {model.__name__}: {exc}")
    dumped = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    lost = list(differences(data, dumped))
    assert not lost, f"{what}: " + "; ".join(lost)


# -- the round-trip check itself -------------------------------------------------------------


def test_validate_reports_a_key_the_schema_does_not_know() -> None:
    podmonitor = _one(PODMONITOR)
    podmonitor["spec"]["podMetricsEndpoints"][0]["portName"] = "gr-metrics"
    with pytest.raises(AssertionError, match=r"spec\.podMetricsEndpoints\[0\]\.portName"):
        validate(v1.PodMonitor, podmonitor, "mutated PodMonitor")


# -- PodMonitor and PrometheusRule -----------------------------------------------------------


def test_podmonitor_is_a_valid_podmonitor_with_no_unknown_keys() -> None:
    validate(v1.PodMonitor, _one(PODMONITOR), str(PODMONITOR))


def test_prometheusrule_is_a_valid_prometheusrule_with_no_unknown_keys() -> None:
    validate(v1.PrometheusRule, _one(PROMETHEUSRULE), str(PROMETHEUSRULE))


def test_prometheusrule_groups_equal_the_rules_file() -> None:
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert _one(PROMETHEUSRULE)["spec"] == {"groups": rules["groups"]}


def test_prometheusrule_is_rendered_from_the_current_rules_file() -> None:
    result = subprocess.run(
        [sys.executable, str(RENDER), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_render_check_fails_when_the_rules_file_changed(tmp_path: Path) -> None:
    (tmp_path / "kubernetes").mkdir()
    (tmp_path / "prometheus").mkdir()
    shutil.copy(RENDER, tmp_path / "kubernetes" / RENDER.name)
    shutil.copy(PROMETHEUSRULE, tmp_path / "kubernetes" / PROMETHEUSRULE.name)
    changed = RULES.read_text(encoding="utf-8").replace("for: 15m", "for: 20m", 1)
    (tmp_path / "prometheus" / RULES.name).write_text(changed, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "kubernetes" / RENDER.name), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "stale" in result.stderr


# -- the example pod -------------------------------------------------------------------------


def test_example_pod_metadata_containers_and_volumes_are_valid_with_no_unknown_keys() -> None:
    deployment = _of_kind("Deployment")
    validate(ObjectMeta, deployment["metadata"], "Deployment metadata")
    validate(ObjectMeta, deployment["spec"]["template"]["metadata"], "pod template metadata")
    validate(ObjectMeta, _of_kind("ConfigMap")["metadata"], "ConfigMap metadata")
    for container in _pod_spec()["containers"]:
        validate(v1.Container, container, f"container {container.get('name')}")
    for volume in _pod_spec()["volumes"]:
        validate(v1.Volume, volume, f"volume {volume.get('name')}")


def test_example_pod_sets_only_known_variables() -> None:
    unknown = set(_env()) - set(ENV_VARS) - OTHER_ENV
    assert not unknown, sorted(unknown)


def test_example_pod_settings_and_config_file_are_accepted(tmp_path: Path) -> None:
    env = _env()
    config_map = _of_kind("ConfigMap")
    key = Path(env["GUARDRAILS_CONFIG_FILE"]).name
    config = tmp_path / key
    config.write_text(config_map["data"][key], encoding="utf-8")
    settings = GuardSettings(environ={**env, "GUARDRAILS_CONFIG_FILE": str(config)})
    assert settings.metrics.port == int(env["GUARDRAILS_METRICS_PORT"])
    assert settings.metrics.addr == "0.0.0.0"
    assert settings.origin("sites", "model.logits", "count_neginf").startswith(str(config))


def test_example_config_file_is_mounted_from_the_configmap() -> None:
    path = Path(_env()["GUARDRAILS_CONFIG_FILE"])
    (mount,) = [m for m in _container()["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in _pod_spec()["volumes"] if v["name"] == mount["name"]]
    config_map = _of_kind("ConfigMap")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert path.name in config_map["data"]
    tomllib.loads(config_map["data"][path.name])


def test_example_multiprocess_dir_is_an_emptydir_mount() -> None:
    path = _env()["PROMETHEUS_MULTIPROC_DIR"]
    (mount,) = [m for m in _container()["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in _pod_spec()["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume


def test_podmonitor_selects_the_example_pod_and_takes_its_job_label() -> None:
    spec = _one(PODMONITOR)["spec"]
    deployment = _of_kind("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["jobLabel"] in pod_labels


def test_podmonitor_scrapes_the_named_port_guardrails_serves_on() -> None:
    (endpoint,) = _one(PODMONITOR)["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in _container()["ports"] if p.get("name") == endpoint["port"]]
    assert PORT_NAME.match(port["name"]), f"{port['name']!r} is not a valid port name"
    assert port["containerPort"] == int(_env()["GUARDRAILS_METRICS_PORT"])
    assert endpoint["path"] == "/metrics"
