"""Fuzzing the settings: random TOML documents, random values for every GUARDRAILS_* variable.

Every input either builds a `GuardSettings` or raises `ConfigError` whose every problem names
its origin (the variable, or the file); nothing else escapes. And no value, however malformed,
switches protection off: a built snapshot guards every known site (each heals and counts a
NaN) unless that site, or guarding altogether, was switched off explicitly, with a documented
false spelling or a site list that names it.

`RELIABILITY_FUZZ_SCALE` (default 1) multiplies the example budgets (`tests/budget.py`).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import math
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from guardrails import ConfigError, Guardrails, GuardSettings
from guardrails.reporting.metrics import resolve_rank
from guardrails.settings import ENV_VARS, KNOWN_SITES, MetricsSettings, SiteSettings, toml
from guardrails.sites import DisabledSite
from guardrails.testing import SilentLogger, fresh_guardrails
from tests.budget import budget

# The spellings pydantic reads as false (case-insensitive): the only way to switch off.
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
SWITCHES = ("enabled", "sanitize", "async_assert")
TOKEN_SITES = frozenset({"sampler.token_ids", "eagle.token_ids"})


def is_false_spelling(value: object) -> bool:
    if isinstance(value, bool):
        return value is False
    if isinstance(value, int):
        return value == 0
    return isinstance(value, str) and value.lower() in FALSE_WORDS


# -- TOML documents ------------------------------------------------------------------------


def toml_document(doc: Mapping[str, Any]) -> str:
    """One `key = value` line per top-level key; tables and arrays of tables inline."""
    return "".join(f"{toml.string(key)} = {toml.value(value)}\n" for key, value in doc.items())


SCALARS = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=16),
    st.datetimes(timezones=st.sampled_from((None, dt.UTC))),
    st.dates(),
    st.times(),
)
ANYTHING = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
# Per key: values the settings accept (the protection-relevant ones among them: every false
# spelling, narrowed and disabled site lists) and values they must reject.
ACCEPTED: dict[str, list[Any]] = {
    "enabled": [True, False, "true", "off", "No", 0, 1, "yes", "f", "N"],
    "enabled_sites": [["*"], ["sampler.*"], ["sampler.logits", "model.logits"], ["eagle.*"]],
    "disabled_sites": [[], ["eagle.*"], ["sampler.token_ids"], ["*.logits"], ["sampler.logits"]],
    "min_temperature": [1e-5, 0.5, 1, 1e-30],
    "log_interval_s": [60, 0.5, 1e-9],
    "log_format": ["host", "json"],
    "every_calls": [1, 32, 10**6],
    "port": [0],  # a served port is a fault test of its own
    "addr": ["127.0.0.1", "0.0.0.0", "::1"],
    "nan_value": [-math.inf, -1e4, 0.0],
    "posinf_value": [1e4, 100.0],
    "dtypes": [["float32"], ["float16", "bfloat16"], ["float64", "float32"]],
    "replacement_id": [0, 5],
    "abort_on": [[], ["nan"], ["any"]],
    "site": ["sampler.logits", "custom.site"],
    "target": ["pkg.mod:Cls.meth", "a.b:c"],
    "tensor": ["return", "arg:logits", "return:0.logits"],
    "kind": ["logits"],
    "vocab_size_from": [],
    "vocab_size": [],
    "when": ["sglang>=0.5.14", "vllm==0.33.0"],
    "labels": [{}, {"model_name": "m"}, {"engine": "0", "tp_rank": "1"}],
    "dir": ["/", "."],
    "on_no_valid_token": ["sample"],
    "eos_token_id": [2],
    "logits_site": ["sampler.logits", "custom.site"],
    "hooks": [[]],
    "expect_calls": [True, False, "yes", "off"],
    "heartbeat": ["pkg.mod:Cls.meth", ["a.b:c", "x.y:Z.w"], []],
    "liveness_steps": [1, 256, 10**9],
}
REJECTED: dict[str, list[Any]] = {
    "enabled": [0.0, 1.0, 2, "", " false", "disable", "nein"],
    "enabled_sites": [[], ["nope"], "sampler.logits", [1]],
    "disabled_sites": [["nope"], [""], "x"],
    "min_temperature": [0, -1.0, math.nan, math.inf, "1e-5x"],
    "log_interval_s": [0, math.inf, -1],
    "log_format": ["xml", ""],
    "every_calls": [0, 10**7, 1.5],
    "port": [-1, 70000, "9400x"],
    "addr": [""],
    "nan_value": [math.nan, math.inf, 1e30],
    "posinf_value": [math.inf, 1e30, math.nan],
    "dtypes": [[], ["int8"], "float32x"],
    "replacement_id": [-1, 0.5],
    "abort_on": [["bogus"]],
    "site": ["bad name!", ""],
    "target": ["os:system('x')", "x", "__import__('os')"],
    "tensor": ["__import__('os')", "arg:", "return()"],
    "kind": ["x", "token_ids"],
    "vocab_size_from": ["arg:logits", "return", "lambda: 1"],
    "vocab_size": [10, 0],
    "when": ["sglang>=x", "sglang; os_name=='nt'", "__import__('os')"],
    "labels": [{"site": "x"}, {"__x": "1"}, {"bad-name": "1"}, "model_name"],
    "dir": ["/nonexistent/guardrails", "/dev/null"],
    "on_no_valid_token": ["eos", "error", ""],
    "eos_token_id": [-1, 0.5, True],
    "logits_site": ["bad name!", ""],
    "hooks": [["nope"], "x"],
    "expect_calls": [0.0, "nope", 2],
    "heartbeat": ["x", ["os:system('x')"], [1]],
    "liveness_steps": [0, -1, 1.5, True, 10**10],
}
for _name in ("sanitize", "async_assert", "count_neginf", "strict_attach"):
    ACCEPTED[_name] = ACCEPTED["enabled"]
    REJECTED[_name] = REJECTED["enabled"]


def value_for(key: str, *, wild: bool) -> st.SearchStrategy[Any]:
    if not wild:
        return st.sampled_from(ACCEPTED[key])
    pool = ACCEPTED.get(key, []) + REJECTED.get(key, [])
    return st.one_of(st.sampled_from(pool), ANYTHING) if pool else ANYTHING


def table(fields: Any, *, wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    fields = [f for f in fields if wild or ACCEPTED[f]]
    known = st.fixed_dictionaries({}, optional={f: value_for(f, wild=wild) for f in fields})
    if not wild:
        return known
    extra = st.dictionaries(st.text(min_size=1, max_size=10), ANYTHING, max_size=1)
    return st.builds(lambda a, b: {**b, **a}, known, st.just({}) | extra)


def documents(*, wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Accepted values only (most build), or anything near or far from them (most fail)."""
    anything = ANYTHING if wild else st.nothing()
    tables = {
        "reporting": table(("log_interval_s", "log_format", "every_calls"), wild=wild),
        "metrics": table(MetricsSettings.model_fields, wild=wild),
        "sites": st.dictionaries(SITE_NAMES, table(SiteSettings.model_fields, wild=wild)),
        "attach": st.lists(
            table(("site", "target", "tensor", "kind", "vocab_size", "vocab_size_from"), wild=wild),
            max_size=2,
        ),
    }
    optional = {
        **{f: value_for(f, wild=wild) for f in (*SWITCHES, "enabled_sites", "disabled_sites")},
        "min_temperature": value_for("min_temperature", wild=wild),
        "heartbeat": value_for("heartbeat", wild=wild),
        "liveness_steps": value_for("liveness_steps", wild=wild),
        **{name: strategy | anything for name, strategy in tables.items()},
    }
    if wild:
        optional["config_file"] = st.text(max_size=8)
    known = st.fixed_dictionaries({}, optional=optional)
    if not wild:
        return known
    extra = st.dictionaries(st.text(min_size=1, max_size=10), ANYTHING, max_size=1)
    return st.builds(lambda a, b: {**b, **a}, known, st.just({}) | extra)


SITE_NAMES = st.one_of(st.sampled_from([*KNOWN_SITES, "custom.site", "x"]), st.text(max_size=12))
DOCUMENTS = documents(wild=False) | documents(wild=True)


def _normalised(value: Any) -> Any:
    """NaN made comparable, for the round-trip check of the TOML writer."""
    if isinstance(value, float) and math.isnan(value):
        return "<nan>"
    if isinstance(value, list):
        return [_normalised(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalised(v) for k, v in value.items()}
    return value


# -- the properties ------------------------------------------------------------------------


def raw_value(settings_: GuardSettings, key: str, env: Mapping[str, str], doc: Any) -> Any:
    """The value of top-level `key` as its source gave it (env string or file value)."""
    origin = settings_.origin(key)
    if origin.startswith("GUARDRAILS_"):
        return env[origin]
    if isinstance(doc, dict) and key in doc:
        return doc[key]
    raise AssertionError(f"{key} came from {origin}, which this test did not provide")


def assert_protection_kept(
    settings_: GuardSettings, env: Mapping[str, str], doc: Any = None
) -> None:
    """Nothing switched off but what was named explicitly; every other site guards."""
    for key in SWITCHES:
        if key != "async_assert" and not getattr(settings_, key):
            assert settings_.origin(key) != "default", key
            assert is_false_spelling(raw_value(settings_, key, env, doc)), key
    if not settings_.enabled:
        return
    for name in KNOWN_SITES:
        if settings_.is_site_enabled(name):
            continue
        narrowed = settings_.origin("enabled_sites") != "default" and not any(
            fnmatch.fnmatchcase(name, p) for p in settings_.enabled_sites
        )
        named_off = settings_.origin("disabled_sites") != "default" and any(
            fnmatch.fnmatchcase(name, p) for p in settings_.disabled_sites
        )
        assert narrowed or named_off, name
    for name, site in settings_.sites.items():
        if site.sanitize is False:
            assert settings_.origin("sites", name, "sanitize") != "default"


def assert_sites_guard(settings_: GuardSettings) -> None:
    """A NaN (an out-of-vocab id) reaches every enabled known site and is counted there."""
    # The metrics server and the JSON log set-up are side effects outside this property.
    snapshot = settings_.model_copy(
        update={
            "metrics": MetricsSettings(),
            "reporting": settings_.reporting.model_copy(update={"log_format": "host"}),
        }
    )
    from prometheus_client import CollectorRegistry

    with Guardrails(snapshot, registry=CollectorRegistry(), logger=SilentLogger()) as guards:
        for name in KNOWN_SITES:
            config = settings_.site_settings(name)
            if name in TOKEN_SITES:
                vocab = max(8, config.replacement_id + 1)
                site: Any = guards.token_site(name, vocab_size=vocab)
                value = torch.tensor([1, vocab + 5])
                kind = "oob_token"
            else:
                site = guards.site(name)
                value = torch.zeros(2, 4, dtype=getattr(torch, config.dtypes[0]))
                value[0, 1] = math.nan
                kind = "nan"
            if not settings_.is_site_enabled(name):
                assert isinstance(site, DisabledSite)
                assert site(value) is None
                continue
            if config.async_assert:
                with pytest.raises(RuntimeError, match=name):
                    site(value)  # CI mode: fails at the origin, after counting
            else:
                flags = site(value)
                assert flags is not None
                assert int(flags.max()) != 0
                if config.sanitize and kind == "nan":
                    assert not bool(value.isnan().any())
            assert guards.count(name, kind) == 1, name


def assert_problems_name_origins(error: ConfigError, origins: tuple[str, ...]) -> None:
    assert error.problems
    for problem in error.problems:
        assert any(origin in problem.where for origin in origins), problem
        assert problem.message


@budget(400)
@given(doc=DOCUMENTS)
def test_random_toml_documents_build_or_fail_naming_the_file(doc: dict[str, Any]) -> None:
    text = toml_document(doc)
    assert _normalised(tomllib.loads(text)) == _normalised(doc)  # the writer is right
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "guardrails.toml"
        path.write_text(text, encoding="utf-8")
        try:
            built = GuardSettings(environ={}, config_file=path)
        except ConfigError as error:
            event("ConfigError")
            assert_problems_name_origins(error, (str(path), "argument config_file"))
            return
    event("built")
    assert_protection_kept(built, {}, doc)
    assert_sites_guard(built)


@budget(200)
@given(text=st.text(max_size=200), cut=st.integers(0, 200), doc=DOCUMENTS)
def test_malformed_toml_fails_naming_the_file(text: str, cut: int, doc: dict[str, Any]) -> None:
    # Random text, and valid documents cut short at a random character.
    for body in (text, toml_document(doc)[:cut]):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "guardrails.toml"
            path.write_text(body, encoding="utf-8")
            try:
                built = GuardSettings(environ={}, config_file=path)
            except ConfigError as error:
                assert_problems_name_origins(error, (str(path), "argument config_file"))
                continue
            # Read back as the library reads it (universal newlines: a lone \r is a newline).
            assert_protection_kept(built, {}, tomllib.loads(path.read_text(encoding="utf-8")))


# -- environment variables -----------------------------------------------------------------

ENV_ACCEPTED: dict[str, list[str]] = {
    "GUARDRAILS_ENABLED": ["true", "false", "1", "0", "yes", "no", "on", "off", "n", "FALSE"],
    "GUARDRAILS_SITES": ["*", "sampler.logits", "sampler.*,model.logits", "eagle.*"],
    "GUARDRAILS_DISABLED_SITES": ["", "eagle.*", "sampler.token_ids", "sampler.*", "*.logits"],
    "GUARDRAILS_MIN_TEMPERATURE": ["1e-5", "0.01", "1"],
    "GUARDRAILS_LOG_INTERVAL_S": ["60", "0.5"],
    "GUARDRAILS_REPORT_INTERVAL_S": ["2", "0.25"],
    "GUARDRAILS_LOG_FORMAT": ["host", "json"],
    "GUARDRAILS_REPORT_EVERY": ["1", "32", "1000000"],
    "GUARDRAILS_METRICS_PORT": ["0"],  # a served port is a fault test of its own
    "GUARDRAILS_METRICS_ADDR": ["127.0.0.1", "0.0.0.0", "::1"],
    "GUARDRAILS_CONFIG_FILE": [""],
    "GUARDRAILS_METRICS_LABELS": ["", "model_name=m", "model_name=m,engine=0"],
    "GUARDRAILS_HOOKS": [""],
    "GUARDRAILS_HEARTBEAT": ["", "pkg.mod:Cls.meth", "a.b:c, x.y:Z.w"],
    "GUARDRAILS_LIVENESS_STEPS": ["1", "256", "1000000000"],
    "GUARDRAILS_METRICS_DIR": ["", "/", "."],
    "GUARDRAILS_TRACE": ["", "model.layers.*", "model.layers.*, model.norm"],
    "GUARDRAILS_TRACE_MODE": ["always", "armed", "every:16"],
}
ENV_REJECTED: dict[str, list[str]] = {
    "GUARDRAILS_ENABLED": ["", "2", "0.0", "disable", "nein"],
    "GUARDRAILS_SITES": [",", "", "nope", "sampler.logit"],
    "GUARDRAILS_DISABLED_SITES": ["nope", "*.nothing"],
    "GUARDRAILS_MIN_TEMPERATURE": ["0", "-1", "nan", "inf", "1e-5s"],
    "GUARDRAILS_LOG_INTERVAL_S": ["0", "1e400", "-1"],
    "GUARDRAILS_REPORT_INTERVAL_S": ["0", "inf", "nan", "-2", "2s"],
    "GUARDRAILS_LOG_FORMAT": ["HOST", "xml"],
    "GUARDRAILS_REPORT_EVERY": ["0", "1e3", "1000001"],
    "GUARDRAILS_METRICS_PORT": ["65536", "-1", "http"],
    "GUARDRAILS_METRICS_ADDR": [""],
    "GUARDRAILS_CONFIG_FILE": ["/nonexistent/guardrails.toml", ".", "/dev/null/x"],
    "GUARDRAILS_METRICS_LABELS": ["site=x", "model_name", "1x=y", "__a=b"],
    "GUARDRAILS_HOOKS": ["nope", "vllm."],
    "GUARDRAILS_HEARTBEAT": ["x", "os:system('x')", "a.b:c,nope"],
    "GUARDRAILS_LIVENESS_STEPS": ["0", "-1", "1.5", "true", "1e3"],
    "GUARDRAILS_METRICS_DIR": ["/nonexistent/guardrails", "/dev/null"],
    "GUARDRAILS_TRACE": ["model layers", "a,b c"],
    "GUARDRAILS_TRACE_MODE": ["", "sometimes", "every:0", "every:1.5"],
}
for _name in ("GUARDRAILS_SANITIZE", "GUARDRAILS_ASYNC_ASSERT", "GUARDRAILS_STRICT_ATTACH"):
    ENV_ACCEPTED[_name] = ENV_ACCEPTED["GUARDRAILS_ENABLED"]
    ENV_REJECTED[_name] = ENV_REJECTED["GUARDRAILS_ENABLED"]


def _near_misses(value: str) -> list[str]:
    return [
        value.upper(),
        f" {value}",
        f"{value}\n",
        f"{value}x",
        f"+{value}",
        value.replace("1", "\u0661").replace("0", "\uff10"),  # Arabic-Indic, fullwidth
        f"{value}\x00",
    ]


def env_value(name: str, *, wild: bool) -> st.SearchStrategy[str]:
    if not wild:
        return st.sampled_from(ENV_ACCEPTED[name])
    known = ENV_ACCEPTED[name] + ENV_REJECTED[name]
    return st.one_of(
        st.sampled_from(known),
        st.sampled_from(known).flatmap(lambda v: st.sampled_from(_near_misses(v))),
        st.text(max_size=12),
        st.text(st.characters(codec="utf-8", categories=("Cc", "Zs", "Nd", "No")), max_size=6),
        st.sampled_from(["\udcff", "\udc80abc"]),  # surrogate-escaped bytes, as in os.environ
        st.floats().map(repr),
        st.integers().map(str),
    )


def environments(*, wild: bool) -> st.SearchStrategy[dict[str, str]]:
    names = st.sets(st.sampled_from(sorted(ENV_VARS)), min_size=1, max_size=5)
    return names.flatmap(
        lambda chosen: st.fixed_dictionaries(
            {name: env_value(name, wild=wild) for name in sorted(chosen)}
        )
    )


ENVIRONMENTS = environments(wild=False) | environments(wild=True)
# Typos of real variables: each must fail, never be ignored.
UNKNOWN = st.none() | st.sampled_from(["GUARDRAILS_SANTIZE", "GUARDRAILS_ENABLE", "GUARDRAILS_"])


@budget(400)
@given(env=ENVIRONMENTS, unknown=UNKNOWN, doc=st.none() | DOCUMENTS)
def test_random_environments_build_or_fail_naming_the_variable(
    env: dict[str, str], unknown: str | None, doc: dict[str, Any] | None
) -> None:
    if unknown is not None:
        env = {**env, unknown: "false"}
    origins: tuple[str, ...] = tuple(env)
    with tempfile.TemporaryDirectory() as tmp:
        if doc is not None and "GUARDRAILS_CONFIG_FILE" not in env:
            path = Path(tmp) / "guardrails.toml"
            path.write_text(toml_document(doc), encoding="utf-8")
            env = {**env, "GUARDRAILS_CONFIG_FILE": str(path)}
            origins = (*origins, str(path))
        try:
            built = GuardSettings(environ=env)
        except ConfigError as error:
            event("ConfigError")
            assert_problems_name_origins(error, origins)
            return
    event("built")
    assert unknown is None  # an unknown variable always fails
    assert_protection_kept(built, env, doc)
    assert_sites_guard(built)


@pytest.mark.parametrize("value", ["0.0", "1.0"])
@pytest.mark.parametrize("key", ["enabled", "sanitize"])
def test_a_float_is_not_a_switch(tmp_path: Path, key: str, value: str) -> None:
    # Found by the document fuzz: pydantic read `enabled = 0.0` as false, one more way to
    # switch guarding off than the documented spellings.
    path = tmp_path / "guardrails.toml"
    path.write_text(f"{key} = {value}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"{key}=.*not a float"):
        GuardSettings(environ={}, config_file=path)


def test_a_config_path_with_a_nul_byte_is_a_config_error() -> None:
    # Found by the environment fuzz: the OS refuses the path with ValueError, which escaped.
    with pytest.raises(ConfigError, match=r"config_file.*embedded null byte"):
        GuardSettings(environ={}, config_file="guardrails\x00.toml")


@pytest.mark.parametrize("value", [1, True, 0.5, b"guardrails.toml"])
def test_a_config_path_that_is_no_path_is_a_config_error(value: object) -> None:
    # A bare TypeError from pathlib escaped before the field's own validation could name it.
    with pytest.raises(ConfigError, match=r"argument config_file.*not a valid path") as caught:
        GuardSettings(environ={}, config_file=value)  # type: ignore[arg-type]
    assert len(caught.value.problems) == 1


# -- the rank label ------------------------------------------------------------------------


@budget(300)
@given(rank=st.text(max_size=6), local_rank=st.none() | st.text(max_size=6))
def test_any_rank_variable_gives_a_decimal_label(rank: str, local_rank: str | None) -> None:
    env = {"RANK": rank} if local_rank is None else {"RANK": rank, "LOCAL_RANK": local_rank}
    label = resolve_rank(env)
    assert label.isascii()
    assert label.isdigit()
    assert label == str(int(label))


def test_a_superscript_rank_does_not_break_site_creation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by the rank fuzz: "²".isdigit() is true but int("²") raises, which escaped from
    # site creation (for the default instance: from the first sampling call).
    monkeypatch.setenv("RANK", "²")
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    with fresh_guardrails(registry=registry) as guards:
        x = torch.tensor([[math.nan, 0.0]])
        assert guards.site("sampler.logits")(x) is not None
    labels = {"site": "sampler.logits", "kind": "nan", "rank": "0"}
    assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 1
