"""The /metrics server started by GUARDRAILS_METRICS_PORT, and the exposition format itself."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

import guardrails as gr
from guardrails.testing import fresh_guardrails

LOGITS = "sampler.logits"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def nan_logits() -> torch.Tensor:
    logits = torch.randn(2, 8)
    logits[0, :3] = math.nan
    return logits


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def occupied() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_metrics_port_serves_the_counters(port: int) -> None:
    guards = fresh_guardrails(
        environ={"GUARDRAILS_METRICS_PORT": str(port)}, reporting={"every_calls": 1}
    )
    try:
        guards.site(LOGITS)(nan_logits())
        text = scrape(port)
    finally:
        guards.close()
    assert 'guardrails_nonfinite_values_total{kind="nan",rank="0",site="sampler.logits"} 3.0' in (
        text
    )


def test_port_in_use_is_a_config_error_naming_the_variable(occupied: int) -> None:
    with pytest.raises(gr.ConfigError) as info:
        fresh_guardrails(environ={"GUARDRAILS_METRICS_PORT": str(occupied)})
    message = str(info.value)
    assert f"GUARDRAILS_METRICS_PORT={occupied}" in message
    assert f"127.0.0.1:{occupied}" in message
    assert isinstance(info.value.__cause__, OSError)


def test_port_in_use_from_a_config_file_names_the_file_key(occupied: int, tmp_path: Path) -> None:
    config = tmp_path / "guardrails.toml"
    config.write_text(f"[metrics]\nport = {occupied}\n")
    with pytest.raises(gr.ConfigError, match=r"guardrails\.toml: metrics\.port"):
        fresh_guardrails(environ={"GUARDRAILS_CONFIG_FILE": str(config)})


def test_second_instance_on_the_same_port_shares_the_server(port: int) -> None:
    registry = CollectorRegistry()
    env = {"GUARDRAILS_METRICS_PORT": str(port)}
    first = fresh_guardrails(environ=env, registry=registry, reporting={"every_calls": 1})
    second = fresh_guardrails(environ=env, registry=registry, reporting={"every_calls": 1})
    try:
        first.site(LOGITS)(nan_logits())
        second.site(LOGITS)(nan_logits())
        first.close()
        text = scrape(port)
    finally:
        first.close()
        second.close()
    assert 'guardrails_nonfinite_values_total{kind="nan",rank="0",site="sampler.logits"} 6.0' in (
        text
    )


def test_closing_the_last_instance_frees_the_port(port: int) -> None:
    env = {"GUARDRAILS_METRICS_PORT": str(port)}
    fresh_guardrails(environ=env).close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_exposition_passes_promtool_lint() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; .ci/run installs it)")
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1})
    guards.site(LOGITS)(nan_logits())
    guards.token_site("sampler.token_ids", vocab_size=4)(torch.tensor([1, 9]))
    guards.close()
    lint = subprocess.run(
        [promtool, "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
