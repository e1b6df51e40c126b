"""Every problem in one run, bad values that used to slip through, and the notices: settings
that are valid but switch something off or expose something, reported as warnings."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import guardrails as gr
from guardrails.testing import fresh_guardrails


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text(text, encoding="utf-8")
    return path


def problems(**env: str) -> list[gr.Problem]:
    with pytest.raises(gr.ConfigError) as info:
        gr.GuardSettings(environ=env)
    return list(info.value.problems)


# -- every problem in one run ----------------------------------------------------------------


def test_a_replacement_overflow_is_reported_with_the_files_other_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'sanitize = "flase"\n'
        '[sites."sampler.logits"]\n'
        "posinf_value = 1e38\n"  # overflows float16
        '[sites."eagle.verify"]\n'
        "count_neginf = 2\n",
    )
    found = problems(GUARDRAILS_CONFIG_FILE=str(path), GUARDRAILS_SANITZE="1")
    wheres = {p.where for p in found}
    assert wheres == {
        f"{path}: sanitize",
        f'{path}: sites."sampler.logits".posinf_value',
        f'{path}: sites."eagle.verify".count_neginf',
        "GUARDRAILS_SANITZE",
    }


def test_an_unknown_site_in_an_enable_list_is_reported_with_a_type_error() -> None:
    found = problems(GUARDRAILS_SITES="sampler.logit", GUARDRAILS_REPORT_EVERY="often")
    assert {p.where for p in found} == {"GUARDRAILS_SITES", "GUARDRAILS_REPORT_EVERY"}
    assert "did you mean 'sampler.logits'" in str(gr.ConfigError(found))


def test_checks_that_depend_on_an_invalid_value_are_skipped_not_guessed(tmp_path: Path) -> None:
    # posinf_value's bound depends on min_temperature: with that invalid, only it is reported.
    path = write(tmp_path, '[sites."sampler.logits"]\nposinf_value = 1e3\n')
    found = problems(GUARDRAILS_CONFIG_FILE=str(path), GUARDRAILS_MIN_TEMPERATURE="-1")
    assert [p.where for p in found] == ["GUARDRAILS_MIN_TEMPERATURE"]


# -- values that used to slip through ---------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("[reporting]", "every_calls"),
        ("[metrics]", "port"),
        ('[sites."sampler.token_ids"]', "replacement_id"),
    ],
)
def test_a_boolean_is_not_a_count(tmp_path: Path, table: str, key: str) -> None:
    path = write(tmp_path, f"{table}\n{key} = true\n")
    [problem] = problems(GUARDRAILS_CONFIG_FILE=str(path))
    assert problem.where.endswith(f".{key}") or problem.where.endswith(f": {key}")
    assert "not true/false" in problem.message
    assert "integer" in problem.accepted


def test_a_boolean_vocab_size_is_not_a_count(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[[attach]]\nsite = "sampler.token_ids"\ntarget = "m:f"\nkind = "token_ids"\n'
        "vocab_size = true\n",
    )
    [problem] = problems(GUARDRAILS_CONFIG_FILE=str(path))
    assert problem.where == f"{path}: attach[0].vocab_size"


def test_report_every_true_in_the_environment_is_refused() -> None:
    [problem] = problems(GUARDRAILS_REPORT_EVERY="true")
    assert problem.where == "GUARDRAILS_REPORT_EVERY"
    assert problem.accepted == "an integer 1-1000000"


@pytest.mark.parametrize(
    "addr",
    [
        "a" * 300,
        "a" * 64 + ".example.com",
        "bad host",
        "-leading.example",
        "[::1]",
        "127.0.0.1:80",
        "$(touch /tmp/pwned)",
    ],
)
def test_an_address_that_is_no_address_is_a_config_error(addr: str) -> None:
    [problem] = problems(GUARDRAILS_METRICS_ADDR=addr)
    assert problem.where == "GUARDRAILS_METRICS_ADDR"
    assert problem.accepted == "an IP address or host name"


@pytest.mark.parametrize(
    "addr", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "metrics.internal", "host-1."]
)
def test_addresses_and_host_names_are_accepted(addr: str) -> None:
    assert gr.GuardSettings(environ={"GUARDRAILS_METRICS_ADDR": addr}).metrics.addr == addr


def test_a_very_long_address_with_a_port_fails_at_start_with_a_config_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"GUARDRAILS_METRICS_ADDR": "a" * 300, "GUARDRAILS_METRICS_PORT": str(port)}
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_METRICS_ADDR"):
        fresh_guardrails(environ=env)  # used to raise UnicodeError from the idna codec


# -- notices --------------------------------------------------------------------------------


def notices(**env: str) -> list[gr.Problem]:
    return list(gr.GuardSettings(environ=env).notices)


def test_plain_settings_have_no_notices() -> None:
    assert notices() == []
    assert notices(GUARDRAILS_DISABLED_SITES="eagle.*", GUARDRAILS_METRICS_PORT="9400") == []


def test_disabling_every_site_is_a_notice() -> None:
    [notice] = notices(GUARDRAILS_DISABLED_SITES="*")
    assert (notice.where, notice.value) == ("GUARDRAILS_DISABLED_SITES", "*")
    assert "every site off" in notice.message
    assert "GUARDRAILS_ENABLED=false" in notice.accepted


def test_the_master_switch_off_is_a_notice() -> None:
    [notice] = notices(GUARDRAILS_ENABLED="false")
    assert notice.where == "GUARDRAILS_ENABLED"
    assert "switched off" in notice.message


def test_a_misspelt_site_section_is_a_notice_with_the_closest_name(tmp_path: Path) -> None:
    path = write(tmp_path, '[sites."sampler.logit"]\ncount_neginf = true\n')
    [notice] = notices(GUARDRAILS_CONFIG_FILE=str(path))
    assert notice.where == f'{path}: sites."sampler.logit"'
    assert "did you mean 'sampler.logits'?" in notice.message


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        ('[[attach]]\nsite = "my.logits"\ntarget = "m:f"\n', {"GUARDRAILS_HEARTBEAT": "m:g"}),
        ("", {"GUARDRAILS_SITES": "my.logits,sampler.*"}),
        ("", {"GUARDRAILS_DISABLED_SITES": "my.logits"}),
        ("", {"GUARDRAILS_SITES": "my.*"}),
    ],
)
def test_a_site_section_used_by_attach_or_an_enable_list_is_no_notice(
    tmp_path: Path, extra: str, env: dict[str, str]
) -> None:
    path = write(tmp_path, f'[sites."my.logits"]\ncount_neginf = true\n{extra}')
    assert notices(GUARDRAILS_CONFIG_FILE=str(path), **env) == []


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "10.1.2.3", "metrics.internal"])
def test_serving_metrics_beyond_loopback_is_a_notice_naming_the_address(addr: str) -> None:
    [notice] = notices(GUARDRAILS_METRICS_ADDR=addr, GUARDRAILS_METRICS_PORT="9400")
    assert (notice.where, notice.value) == ("GUARDRAILS_METRICS_ADDR", addr)
    assert f"{addr}:9400" in notice.message


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_serving_metrics_on_loopback_is_no_notice(addr: str) -> None:
    assert notices(GUARDRAILS_METRICS_ADDR=addr, GUARDRAILS_METRICS_PORT="9400") == []


def test_a_non_loopback_address_without_a_server_is_no_notice() -> None:
    assert notices(GUARDRAILS_METRICS_ADDR="0.0.0.0") == []
