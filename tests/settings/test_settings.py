"""GuardSettings: every variable, the file, precedence, and every kind of bad input."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest

import guardrails as gr
from guardrails.flags import ANY_FLAG
from guardrails.settings import ENV_VARS, KNOWN_SITES
from guardrails.settings.models import SiteSettings

ROOT = Path(__file__).resolve().parents[2]

# One accepted and one rejected value for every variable, with the parsed result.
GOOD_AND_BAD = {
    "GUARDRAILS_ENABLED": ("off", ("enabled",), False, "maybe"),
    "GUARDRAILS_SANITIZE": ("0", ("sanitize",), False, "flase"),
    "GUARDRAILS_ASYNC_ASSERT": ("yes", ("async_assert",), True, "2"),
    "GUARDRAILS_SITES": (
        " sampler.* , eagle.verify ",
        ("enabled_sites",),
        ("sampler.*", "eagle.verify"),
        "smapler.logits",
    ),
    "GUARDRAILS_DISABLED_SITES": (
        "eagle.*",
        ("disabled_sites",),
        ("eagle.*",),
        "nosuch.*",
    ),
    "GUARDRAILS_CONFIG_FILE": ("", ("config_file",), None, "/nonexistent/guardrails.toml"),
    "GUARDRAILS_MIN_TEMPERATURE": ("0.05", ("min_temperature",), 0.05, "0"),
    "GUARDRAILS_LOG_INTERVAL_S": ("2.5", ("reporting", "log_interval_s"), 2.5, "-1"),
    "GUARDRAILS_REPORT_INTERVAL_S": ("0.5", ("reporting", "report_interval_s"), 0.5, "0"),
    "GUARDRAILS_LOG_FORMAT": ("json", ("reporting", "log_format"), "json", "xml"),
    "GUARDRAILS_REPORT_EVERY": ("8", ("reporting", "every_calls"), 8, "0"),
    "GUARDRAILS_METRICS_PORT": ("9400", ("metrics", "port"), 9400, "70000"),
    "GUARDRAILS_METRICS_ADDR": ("0.0.0.0", ("metrics", "addr"), "0.0.0.0", ""),
    "GUARDRAILS_METRICS_LABELS": (
        "model_name=m, engine=0",
        ("metrics", "labels"),
        {"model_name": "m", "engine": "0"},
        "site=x",
    ),
    "GUARDRAILS_STRICT_ATTACH": ("on", ("strict_attach",), True, "2"),
    "GUARDRAILS_HOOKS": ("", ("hooks",), (), "no.such.hook"),
    "GUARDRAILS_HEARTBEAT": (
        "eng.model:Model.logits, eng.runner:step",
        ("heartbeat",),
        ("eng.model:Model.logits", "eng.runner:step"),
        "eng.model.Model.logits",
    ),
    "GUARDRAILS_LIVENESS_STEPS": ("64", ("liveness_steps",), 64, "0"),
    "GUARDRAILS_METRICS_DIR": ("/", ("metrics", "dir"), Path("/"), "/nonexistent/guardrails"),
    "GUARDRAILS_TRACE": (
        "model.layers.*, model.norm",
        ("trace", "modules"),
        ("model.layers.*", "model.norm"),
        "model layers",
    ),
    "GUARDRAILS_TRACE_MODE": ("every:4", ("trace", "mode"), "every:4", "every:0"),
}


def _get(settings: gr.GuardSettings, path: tuple[str, ...]) -> object:
    value: object = settings
    for part in path:
        value = getattr(value, part)
    return value


def test_table_covers_every_variable() -> None:
    assert set(GOOD_AND_BAD) == set(ENV_VARS)


def test_defaults_match_the_design_brief() -> None:
    s = gr.GuardSettings(environ={})
    assert (s.enabled, s.sanitize, s.async_assert) == (True, True, False)
    assert s.enabled_sites == ("*",)
    assert s.disabled_sites == ()
    assert s.config_file is None
    assert s.min_temperature == 1e-5
    assert s.reporting.log_interval_s == 60
    assert s.metrics.port == 0
    assert s.metrics.addr == "127.0.0.1"


@pytest.mark.parametrize("var", sorted(GOOD_AND_BAD))
def test_each_variable_is_read(var: str) -> None:
    good, path, parsed, _bad = GOOD_AND_BAD[var]
    s = gr.GuardSettings(environ={var: good})
    assert _get(s, path) == parsed
    if good:
        assert s.origin(*path) == var


@pytest.mark.parametrize("var", sorted(GOOD_AND_BAD))
def test_each_bad_value_fails_naming_the_variable(var: str) -> None:
    bad = GOOD_AND_BAD[var][3]
    with pytest.raises(gr.ConfigError) as info:
        gr.GuardSettings(environ={var: bad})
    assert isinstance(info.value, ValueError)
    text = str(info.value)
    assert var in text
    assert "accepted" in text or "does not exist" in text


@pytest.mark.parametrize("var", ["GUARDRAILS_ENABLED", "GUARDRAILS_SANITIZE"])
@pytest.mark.parametrize("bad", ["", "fals", "0.5", "disabled", "nein"])
def test_a_malformed_switch_never_turns_protection_off(var: str, bad: str) -> None:
    with pytest.raises(gr.ConfigError, match=var):
        gr.GuardSettings(environ={var: bad})


def test_all_problems_are_reported_together() -> None:
    env = {
        "GUARDRAILS_SANITIZE": "flase",
        "GUARDRAILS_MIN_TEMPERATURE": "-1",
        "GUARDRAILS_SANITZE": "1",
    }
    with pytest.raises(gr.ConfigError) as info:
        gr.GuardSettings(environ=env)
    wheres = {p.where for p in info.value.problems}
    assert wheres == {"GUARDRAILS_SANITIZE", "GUARDRAILS_MIN_TEMPERATURE", "GUARDRAILS_SANITZE"}


def test_unknown_variable_names_the_closest_one() -> None:
    with pytest.raises(gr.ConfigError, match="did you mean 'GUARDRAILS_SANITIZE'"):
        gr.GuardSettings(environ={"GUARDRAILS_SANITZE": "true"})


def test_other_prefixes_are_ignored() -> None:
    s = gr.GuardSettings(environ={"GUARDRAIL_X": "1", "SGLANG_FOO": "1", "guardrails_x": "1"})
    assert s.enabled


@pytest.mark.parametrize("value", ["nan", "inf", "-0.0", "1e-400"])
def test_min_temperature_must_be_a_positive_finite_number(value: str) -> None:
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_MIN_TEMPERATURE"):
        gr.GuardSettings(environ={"GUARDRAILS_MIN_TEMPERATURE": value})


def test_unknown_site_in_enable_list_names_the_closest_site() -> None:
    with pytest.raises(gr.ConfigError, match=r"did you mean 'sampler\.logits'"):
        gr.GuardSettings(environ={"GUARDRAILS_SITES": "sampler.logit"})


def test_pattern_matching_no_known_site_is_an_error() -> None:
    with pytest.raises(gr.ConfigError, match="matches no known site"):
        gr.GuardSettings(environ={"GUARDRAILS_DISABLED_SITES": "samplr.*"})


@pytest.mark.parametrize("value", ["", " , ", ","])
def test_empty_enable_list_is_an_error_not_an_off_switch(value: str) -> None:
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_ENABLED=false"):
        gr.GuardSettings(environ={"GUARDRAILS_SITES": value})


def test_enable_and_disable_lists_select_sites() -> None:
    s = gr.GuardSettings(
        environ={
            "GUARDRAILS_SITES": "sampler.*,eagle.verify",
            "GUARDRAILS_DISABLED_SITES": "*.token_ids",
        }
    )
    assert s.is_site_enabled("sampler.logits")
    assert s.is_site_enabled("eagle.verify")
    assert not s.is_site_enabled("sampler.token_ids")
    assert not s.is_site_enabled("eagle.draft")


def test_master_switch_disables_every_site() -> None:
    s = gr.GuardSettings(environ={"GUARDRAILS_ENABLED": "false"})
    assert not any(s.is_site_enabled(name) for name in KNOWN_SITES)


# -- the config file ------------------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text(text)
    return path


def test_example_config_documents_every_key_with_its_default() -> None:
    example = ROOT / "config" / "guardrails.example.toml"
    s = gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(example)})
    defaults = gr.GuardSettings(environ={})
    for name in type(s).model_fields:
        if name not in ("config_file", "sites"):
            assert getattr(s, name) == getattr(defaults, name), name
    documented = example.read_text()
    for section in ("reporting", "metrics"):
        for key, field in type(s).model_fields[section].annotation.model_fields.items():
            # A key unset by default is shown commented out, with an example value.
            shown = f"\n# {key} = " if field.default is None else f"\n{key} = "
            assert shown in documented, key
    for key in gr.SiteSettings.model_fields:
        assert f"{key} = " in documented, key
    assert s.site_settings("sampler.logits") == defaults.site_settings("sampler.logits")


def test_file_values_and_per_site_sections_are_read(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
sanitize = false
enabled_sites = ["sampler.*", "my.engine.logits"]
[reporting]
log_interval_s = 5
[sites."my.engine.logits"]
[sites."sampler.logits"]
count_neginf = true
sanitize = true
""",
    )
    s = gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})
    assert s.sanitize is False
    assert s.reporting.log_interval_s == 5
    assert s.is_site_enabled("my.engine.logits")
    site = s.site_settings("sampler.logits")
    assert site.count_neginf
    assert site.sanitize
    assert s.site_settings("sampler.token_ids").sanitize is False  # inherits the global
    assert s.origin("sanitize") == f"{path}: sanitize"


def test_a_copy_resolves_its_own_site_tables() -> None:
    """`site_settings` is resolved once per name (engine hooks ask at every step); a copy with
    other values never answers with the original's tables."""
    s = gr.GuardSettings(environ={}, sites={"sampler.logits": {"abort_on": ("nan",)}})
    first = s.site_settings("sampler.logits")
    assert s.site_settings("sampler.logits") is first
    assert first.abort_flags == int(gr.RowFlag.NAN)
    changed = s.model_copy(
        update={"sanitize": False, "sites": {"sampler.logits": SiteSettings(abort_on=("any",))}}
    )
    assert changed.site_settings("sampler.logits").sanitize is False
    assert changed.site_settings("sampler.logits").abort_flags == int(ANY_FLAG)
    assert copy.deepcopy(changed).site_settings("sampler.logits").abort_flags == int(ANY_FLAG)
    assert s.site_settings("sampler.logits") is first
    assert first.sanitize is True
    assert first.abort_flags == int(gr.RowFlag.NAN)


@pytest.mark.parametrize(
    ("argument", "env", "file", "expected", "origin"),
    [
        (None, None, None, 60.0, "default"),
        (None, None, "7", 7.0, "file"),
        (None, "8", "7", 8.0, "GUARDRAILS_LOG_INTERVAL_S"),
        (9.0, "8", "7", 9.0, "argument"),
    ],
)
def test_precedence_is_argument_then_env_then_file_then_default(
    tmp_path: Path,
    argument: float | None,
    env: str | None,
    file: str | None,
    expected: float,
    origin: str,
) -> None:
    environ = {}
    if file is not None:
        environ["GUARDRAILS_CONFIG_FILE"] = str(
            _write(tmp_path, f"[reporting]\nlog_interval_s = {file}\n")
        )
    if env is not None:
        environ["GUARDRAILS_LOG_INTERVAL_S"] = env
    kwargs = {} if argument is None else {"reporting": {"log_interval_s": argument}}
    s = gr.GuardSettings(environ=environ, **kwargs)
    assert s.reporting.log_interval_s == expected
    where = s.origin("reporting", "log_interval_s")
    assert where.startswith(origin) or (origin == "file" and str(tmp_path) in where)


def test_config_file_argument_works_without_env(tmp_path: Path) -> None:
    path = _write(tmp_path, "sanitize = false\n")
    assert gr.GuardSettings(environ={}, config_file=path).sanitize is False


def test_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARDRAILS_SANITIZE", "false")
    assert gr.GuardSettings().sanitize is False
    assert os.environ["GUARDRAILS_SANITIZE"] == "false"  # read, never written


def test_missing_file_is_an_error_naming_the_variable() -> None:
    with pytest.raises(gr.ConfigError, match=r"GUARDRAILS_CONFIG_FILE.*does not exist"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": "/nonexistent.toml"})


def test_unreadable_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(gr.ConfigError, match="cannot read config file"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(tmp_path)})  # a directory


def test_malformed_toml_is_an_error_with_the_position(tmp_path: Path) -> None:
    path = _write(tmp_path, "sanitize = \n[metrics\n")
    with pytest.raises(gr.ConfigError, match=r"malformed TOML.*line 1"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_binary_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(gr.ConfigError, match=str(path)):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_unknown_file_key_names_the_closest_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "[metrics]\nprot = 9400\n")
    with pytest.raises(gr.ConfigError, match=r"metrics.prot: unknown key; did you mean 'port'"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_unquoted_dotted_site_name_gets_a_quoting_hint(tmp_path: Path) -> None:
    path = _write(tmp_path, "[sites.sampler.logits]\ncount_neginf = true\n")
    with pytest.raises(gr.ConfigError, match="must be quoted"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_wrong_type_in_file_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '[sites."sampler.logits"]\ncount_neginf = "sometimes"\n')
    with pytest.raises(gr.ConfigError) as info:
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})
    (problem,) = info.value.problems
    assert problem.where == f'{path}: sites."sampler.logits".count_neginf'
    assert "true or false" in problem.accepted


def test_file_cannot_name_another_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'config_file = "/etc/other.toml"\n')
    with pytest.raises(gr.ConfigError, match="cannot name another config file"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_replacement_value_that_overflows_float16_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, '[sites."sampler.logits"]\nposinf_value = 1e30\n')
    with pytest.raises(gr.ConfigError, match=r"posinf_value.*overflows float16"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_replacement_value_is_accepted_for_the_dtypes_it_fits(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[sites."sampler.logits"]\nposinf_value = 1e30\nnan_value = -1e30\ndtypes = ["float32"]\n',
    )
    s = gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})
    assert s.site_settings("sampler.logits").posinf_value == 1e30


def test_replacement_value_checked_against_min_temperature() -> None:
    # 1e30 / 1e-10 = 1e40 overflows float32 after temperature division.
    with pytest.raises(gr.ConfigError, match="overflows float32"):
        gr.GuardSettings(
            environ={},
            min_temperature=1e-10,
            sites={"sampler.logits": {"posinf_value": 1e30, "dtypes": ["float32"]}},
        )


@pytest.mark.parametrize(
    ("key", "value"),
    [("posinf_value", math.inf), ("posinf_value", math.nan), ("nan_value", math.nan)],
)
def test_non_finite_replacement_values_are_rejected(key: str, value: float) -> None:
    with pytest.raises(gr.ConfigError, match=key):
        gr.GuardSettings(environ={}, sites={"sampler.logits": {key: value}})


def test_unknown_argument_is_an_error() -> None:
    with pytest.raises(
        gr.ConfigError, match="argument santize: unknown key; did you mean 'sanitize'"
    ):
        gr.GuardSettings(environ={}, santize=False)


def test_settings_are_a_frozen_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    s = gr.GuardSettings(environ={})
    with pytest.raises(ValueError, match="frozen"):
        s.sanitize = False  # type: ignore[misc]
    monkeypatch.setenv("GUARDRAILS_SANITIZE", "false")
    assert s.sanitize is True


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_config_path_that_is_not_a_regular_file_is_an_error(path: str) -> None:
    with pytest.raises(gr.ConfigError, match="not a regular file"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": path})


def test_fifo_config_path_fails_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    with pytest.raises(gr.ConfigError, match="not a regular file"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(fifo)})


def test_oversized_config_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.toml"
    path.write_text("# padding\n" * 200_000)
    with pytest.raises(gr.ConfigError, match="larger than"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})


def test_config_file_behind_a_symlink_is_read(tmp_path: Path) -> None:
    real = tmp_path / "real.toml"
    real.write_text("sanitize = false\n")
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(link)}).sanitize is False


def test_config_path_with_an_unknown_user_is_an_error() -> None:
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_CONFIG_FILE"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": "~no-such-user-guardrails/g.toml"})


@pytest.mark.parametrize("name", ["bad name!", "", "x" * 101, "sampler/logits"])
def test_a_site_table_with_an_invalid_name_is_refused(tmp_path: Path, name: str) -> None:
    # Site names become metric label values: a [sites."..."] key is held to the same rule as
    # an [[attach]] site (it used to be accepted and only failed when a site was made).
    path = tmp_path / "g.toml"
    path.write_text(f'[sites."{name}"]\nsanitize = true\n', encoding="utf-8")
    with pytest.raises(gr.ConfigError, match="invalid site name"):
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})
