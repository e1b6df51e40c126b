"""The kinds of value in `guardrails.settings.fields` check themselves, wherever they are used:
alone, inside `X | None`, or as a field of any model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from guardrails.settings.fields import (
    BindAddress,
    CallCount,
    FlagNames,
    HookNames,
    LabelPairs,
    MultiprocDir,
    Port,
    PositiveFinite,
    Ref,
    SiteName,
    StepCount,
    Switch,
    Target,
    Targets,
    TokenId,
    TraceMode,
    TracePatterns,
    VocabSize,
    is_loopback,
)


def _check(kind: Any, value: object) -> Any:
    return TypeAdapter(kind).validate_python(value)


def _refused(kind: Any, value: object) -> str:
    with pytest.raises(ValidationError) as info:
        _check(kind, value)
    return str(info.value)


@pytest.mark.parametrize("kind", [Switch, Switch | None])
@pytest.mark.parametrize("value", [0.0, 1.0])
def test_a_switch_refuses_floats(kind: Any, value: float) -> None:
    assert "a switch takes true or false, not a float" in _refused(kind, value)


@pytest.mark.parametrize(("value", "expected"), [("off", False), ("yes", True), (0, False)])
def test_a_switch_takes_the_documented_spellings(value: object, expected: bool) -> None:
    assert _check(Switch, value) is expected


@pytest.mark.parametrize("kind", [TokenId, VocabSize, Port, CallCount, StepCount, TokenId | None])
def test_a_count_refuses_true_and_false(kind: Any) -> None:
    assert "a number is needed here, not true/false" in _refused(kind, True)


@pytest.mark.parametrize(
    ("kind", "lowest", "highest"),
    [
        (TokenId, 0, None),
        (VocabSize, 1, None),
        (Port, 0, 65535),
        (CallCount, 1, 1_000_000),
        (StepCount, 1, 1_000_000_000),
    ],
)
def test_a_count_keeps_its_bounds(kind: Any, lowest: int, highest: int | None) -> None:
    assert _check(kind, lowest) == lowest
    _refused(kind, lowest - 1)
    if highest is not None:
        assert _check(kind, highest) == highest
        _refused(kind, highest + 1)


def test_bounds_hold_inside_an_optional() -> None:
    assert _check(TokenId | None, None) is None
    assert "greater than or equal to 0" in _refused(TokenId | None, -1)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_a_positive_finite_number_refuses(value: float) -> None:
    _refused(PositiveFinite, value)


def test_names_and_targets_are_checked() -> None:
    assert _check(SiteName, "sampler.logits") == "sampler.logits"
    assert "invalid site name" in _refused(SiteName, "bad name")
    assert _check(Target, "pkg.mod:Cls.meth") == "pkg.mod:Cls.meth"
    _refused(Target, "no colon")
    assert _check(Ref, "arg:logits") == "arg:logits"
    _refused(Ref, "argument")


def test_a_string_is_one_target_and_repeats_collapse() -> None:
    assert _check(Targets, "a.b:C.d") == ("a.b:C.d",)
    assert _check(Targets, ["a.b:C.d", "e:f", "a.b:C.d"]) == ("a.b:C.d", "e:f")
    _refused(Targets, ["a.b:C.d", "broken"])


def test_hooks_and_flags_are_known_names() -> None:
    assert "unknown hook 'nope'" in _refused(HookNames, ["nope"])
    assert _check(FlagNames, [" NaN ", "any"]) == ("nan", "any")
    _refused(FlagNames, ["nope"])


def test_trace_patterns_and_mode() -> None:
    assert _check(TracePatterns, "model.layers.*") == ("model.layers.*",)
    assert "is not a module pattern" in _refused(TracePatterns, ["model layers"])
    assert _check(TraceMode, "every:3") == "every:3"
    _refused(TraceMode, "every:0")


def test_label_pairs_from_the_variable_and_reserved_names() -> None:
    assert _check(LabelPairs, ("model_name=m", " engine = 0 ")) == {
        "model_name": "m",
        "engine": "0",
    }
    assert "is not name=value" in _refused(LabelPairs, ("model_name",))
    assert "a label guardrails sets itself" in _refused(LabelPairs, {"site": "x"})
    assert "is not a Prometheus label name" in _refused(LabelPairs, {"__x": "y"})


def test_bind_addresses() -> None:
    assert _check(BindAddress, "::1") == "::1"
    assert _check(BindAddress, "metrics.local") == "metrics.local"
    assert "not an IP address nor a host name" in _refused(BindAddress, "a..b")
    _refused(BindAddress, "")
    assert is_loopback("127.0.0.1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")


def test_multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _check(MultiprocDir, "") is None
    assert "is not an existing directory" in _refused(MultiprocDir, str(tmp_path / "absent"))
    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _check(MultiprocDir, "d") == tmp_path / "d"
