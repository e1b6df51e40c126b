"""The reporter's event builders are pure: fields in, (level, event, fields) out."""

from __future__ import annotations

from typing import Any

import pytest

from guardrails.flags import CountKind
from guardrails.names import (
    METRICS_SERVED_ELSEWHERE_EVENT,
    NO_VALID_TOKEN_EVENT,
    NONFINITE_EVENT,
    OOB_EVENT,
    REPORTING_ERROR_EVENT,
)
from guardrails.reporting.events import fault_event, served_elsewhere_event, site_event

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
