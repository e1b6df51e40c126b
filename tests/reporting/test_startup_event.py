"""`guardrails.started`: one event per `Guardrails`, saying what guards and what is off, a
warning when a setting switches everything off, exposes /metrics or names no site."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.names import STARTED_EVENT
from guardrails.testing import fresh_guardrails


def started(environ: dict[str, str] | None = None, **settings: Any) -> list[dict[str, Any]]:
    with capture_logs() as logs:
        guards = fresh_guardrails(environ=environ, registry=CollectorRegistry(), **settings)
        guards.site("sampler.logits")
        guards.site("eagle.verify")
        guards.close()
    return [e for e in logs if e["event"] == STARTED_EVENT]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_one_plain_info_event_per_instance() -> None:
    [event] = started()
    assert event["log_level"] == "info"
    assert (event["enabled"], event["sanitize"], event["sites"], event["disabled_sites"]) == (
        True,
        True,
        ["*"],
        [],
    )
    assert (event["metrics_port"], event["metrics_addr"], event["warnings"]) == (0, None, [])


def test_every_site_disabled_is_a_warning_naming_the_variable() -> None:
    [event] = started({"GUARDRAILS_DISABLED_SITES": "*"})
    assert event["log_level"] == "warning"
    assert event["disabled_sites"] == ["*"]
    [warning] = event["warnings"]
    assert warning.startswith("GUARDRAILS_DISABLED_SITES='*': switches every site off")


def test_guardrails_switched_off_is_a_warning() -> None:
    [event] = started({"GUARDRAILS_ENABLED": "false"})
    assert (event["log_level"], event["enabled"]) == ("warning", False)
    assert event["warnings"][0].startswith("GUARDRAILS_ENABLED")


def test_metrics_served_beyond_loopback_is_a_warning_naming_the_address() -> None:
    port = free_port()
    [event] = started({"GUARDRAILS_METRICS_PORT": str(port), "GUARDRAILS_METRICS_ADDR": "0.0.0.0"})
    assert (event["log_level"], event["metrics_addr"], event["metrics_port"]) == (
        "warning",
        "0.0.0.0",
        port,
    )
    [warning] = event["warnings"]
    assert f"served on 0.0.0.0:{port}, reachable from other hosts" in warning


def test_a_misspelt_site_section_is_a_warning_with_the_closest_name(tmp_path: Path) -> None:
    config = tmp_path / "guardrails.toml"
    config.write_text('[sites."sampler.logit"]\ncount_neginf = true\n', encoding="utf-8")
    [event] = started({"GUARDRAILS_CONFIG_FILE": str(config)})
    assert event["config_file"] == str(config)
    [warning] = event["warnings"]
    assert "did you mean 'sampler.logits'?" in warning


def test_each_instance_logs_its_own_start() -> None:
    with capture_logs() as logs:
        for _ in range(3):
            fresh_guardrails(registry=CollectorRegistry()).close()
    assert [e["event"] for e in logs] == [STARTED_EVENT] * 3


@pytest.mark.parametrize("raising", ["info", "warning"])
def test_a_logger_failing_on_the_start_event_never_fails_the_start(raising: str) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            def log(event: str, **fields: Any) -> None:
                if name == raising:
                    raise RuntimeError("log sink is down")

            return log

    environ = {"GUARDRAILS_DISABLED_SITES": "*"} if raising == "warning" else {}
    fresh_guardrails(environ=environ, registry=CollectorRegistry(), logger=Broken()).close()
