"""The reporter's event builders are pure: fields in, (level, event, fields) out."""

from __future__ import annotations

from typing import Any

import pytest

from guardrails.flags import CountKind
from guardrails.names import (
    METRICS_SERVED_ELSEWHERE_EVENT,
    NO_VALID_TOKEN_EVENT,
    NONFINITE_EVENT,
    NONFINITE_ORIGIN_EVENT,
    OOB_EVENT,
    REPORTING_ERROR_EVENT,
    SITE_NOT_CALLED_EVENT,
    STARTED_EVENT,
)
from guardrails.reporting.events import (
    fault_event,
    origin_event,
    served_elsewhere_event,
    site_event,
    site_not_called_event,
    started_event,
)
from guardrails.testing import fresh_guardrails

LOGITS = (
    CountKind.NAN,
    CountKind.POSINF,
    CountKind.NEGINF,
    CountKind.ROWS_NONFINITE,
    CountKind.ROWS_NO_VALID_TOKEN,
)
IDS = (CountKind.OOB_TOKEN, CountKind.ROWS_OOB_TOKEN)


def _logits(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "site": "sampler.logits",
        "kind": "logits",
        "slots": LOGITS,
        "totals": [5, 1, 0, 3, 0],
        "logged": [2, 1, 0, 1, 0],
        "calls_total": 40,
        "logged_calls": 32,
        "suppressed": 2,
        "rank": "0",
        "vocab_size": None,
        "dtype": "float16",
        "shape": (4, 128),
    }
    fields.update(overrides)
    return fields


def test_a_logits_event_carries_deltas_since_the_last_one_and_totals() -> None:
    level, event, fields = site_event(**_logits())
    assert (level, event) == ("warning", NONFINITE_EVENT)
    assert fields == {
        "site": "sampler.logits",
        "rank": "0",
        "nan": 3,
        "nan_total": 5,
        "posinf": 0,
        "posinf_total": 1,
        "neginf": 0,
        "neginf_total": 0,
        "rows_nonfinite": 2,
        "rows_nonfinite_total": 3,
        "rows_no_valid_token": 0,
        "rows_no_valid_token_total": 0,
        "rows": 2,
        "calls": 8,
        "calls_total": 40,
        "dtype": "float16",
        "shape": [4, 128],
        "suppressed": 2,
    }


def test_rows_left_with_no_valid_token_make_an_error_event() -> None:
    level, event, fields = site_event(**_logits(totals=[5, 1, 0, 3, 2], logged=[2, 1, 0, 1, 1]))
    assert (level, event, fields["rows"]) == ("error", NO_VALID_TOKEN_EVENT, 1)


def test_a_token_id_event_names_the_vocabulary() -> None:
    level, event, fields = site_event(
        **_logits(
            site="sampler.token_ids",
            kind="token_ids",
            slots=IDS,
            totals=[7, 3],
            logged=[0, 0],
            vocab_size=1000,
            dtype="int64",
            shape=(3,),
        )
    )
    assert (level, event) == ("error", OOB_EVENT)
    assert (fields["oob_token"], fields["oob_token_total"]) == (7, 7)
    assert (fields["rows"], fields["vocab_size"], fields["shape"]) == (3, 1000, [3])


def test_the_same_fields_give_the_same_event_and_the_inputs_stay_as_they_were() -> None:
    inputs = _logits()
    totals = list(inputs["totals"])
    assert site_event(**inputs) == site_event(**inputs)
    assert inputs["totals"] == totals


def test_counts_that_do_not_match_the_slots_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"sampler.logits.*5 count slots but 4 totals"):
        site_event(**_logits(totals=[1, 2, 3, 4]))


def test_fault_and_served_elsewhere_events() -> None:
    assert fault_event("poll", RuntimeError("boom"), None) == (
        "error",
        REPORTING_ERROR_EVENT,
        {"stage": "poll", "error": "RuntimeError: boom", "rank": None},
    )
    level, event, fields = served_elsewhere_event("127.0.0.1", 9400)
    assert (level, event) == ("info", METRICS_SERVED_ELSEWHERE_EVENT)
    assert (fields["addr"], fields["port"]) == ("127.0.0.1", 9400)


def test_the_started_event_is_a_warning_only_with_warnings() -> None:
    guards = fresh_guardrails(environ={"GUARDRAILS_SANITIZE": "false"})
    try:
        level, event, fields = started_event(guards.settings)
        assert (level, event) == ("info", STARTED_EVENT)
        assert (fields["sanitize"], fields["metrics_addr"], fields["trace"]) == (False, None, None)
        level, _, fields = started_event(guards.settings, ["look here"])
        assert (level, fields["warnings"]) == ("warning", ["look here"])
    finally:
        guards.close()


def test_site_not_called_and_origin_events() -> None:
    level, event, fields = site_not_called_event(
        site="sampler.logits",
        rank="0",
        heartbeat="engine:Runner.step",
        steps=256,
        targets=("engine:Runner.sample",),
        states=("applied",),
        calls_total=0,
    )
    assert (level, event) == ("warning", SITE_NOT_CALLED_EVENT)
    assert (fields["targets"], fields["state"], fields["steps"]) == (
        ["engine:Runner.sample"],
        ["applied"],
        256,
    )
    assert "guardrails check" in fields["action"]
    assert origin_event(
        module="model.layers.3.mlp",
        site="sampler.logits",
        kind="posinf",
        dtype="float16",
        rank="0",
        step=2,
        mode="always",
    ) == (
        "warning",
        NONFINITE_ORIGIN_EVENT,
        {
            "module": "model.layers.3.mlp",
            "site": "sampler.logits",
            "kind": "posinf",
            "dtype": "float16",
            "rank": "0",
            "step": 2,
            "mode": "always",
        },
    )
