"""Corners that used to be wrong (issue 21): each test failed before its fix.

- `on_no_valid_token = "eos"` per thread: another thread's step in between does not let a
  poisoned row through;
- `eos_token_id` outside the vocabulary is refused, as `replacement_id` is;
- `gr.sanitize_logits_` takes SGLang's `sanitize_nan_logits(logits, msg)` call;
- one token-id site at two targets with different vocabularies checks each call against its
  own. (Per-call vocabularies under `torch.compile`: tests/contract/test_compiled.py.)
"""

from __future__ import annotations

import math
import sys
import textwrap
import threading
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import guardrails as gr
from guardrails.flags import RowFlag
from guardrails.testing import SilentLogger, fresh_guardrails, reset_default

NAN = math.nan


def eos_guards() -> gr.Guardrails:
    return fresh_guardrails(
        sites={"sampler.token_ids": {"on_no_valid_token": "eos", "eos_token_id": 2}},
        logger=SilentLogger(),
    )


def test_eos_follows_each_threads_own_step() -> None:
    guards = eos_guards()
    logits_site = guards.site("sampler.logits")
    token_site = guards.token_site("sampler.token_ids", vocab_size=4)
    a_logits_done, b_done = threading.Event(), threading.Event()
    out: dict[str, list[int]] = {}

    def thread_a() -> None:
        logits_site(torch.full((1, 4), NAN))  # A's step: its only row is poisoned
        a_logits_done.set()
        b_done.wait(30)  # B runs a whole step in between
        ids = torch.tensor([0])  # what A sampled from the uniform row
        token_site(ids)
        out["a"] = ids.tolist()

    def thread_b() -> None:
        a_logits_done.wait(30)
        logits_site(torch.tensor([[0.0, 5.0, 1.0, 0.0]]))
        ids = torch.tensor([1])
        token_site(ids)
        out["b"] = ids.tolist()
        b_done.set()

    workers = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert out == {"a": [2], "b": [1]}  # A's poisoned row ends with EOS; B's is untouched
    guards.close()


def test_eos_still_ends_a_row_once_per_step_on_one_thread() -> None:
    guards = eos_guards()
    logits_site = guards.site("sampler.logits")
    token_site = guards.token_site("sampler.token_ids", vocab_size=4)
    logits_site(torch.full((1, 4), NAN))
    first, again = torch.tensor([0]), torch.tensor([0])
    token_site(first)
    token_site(again)  # no new logits call: the old step's flags are not reused
    assert (first.tolist(), again.tolist()) == ([2], [0])
    guards.close()


def test_an_eos_token_id_outside_the_vocabulary_is_refused_when_the_site_is_made() -> None:
    guards = fresh_guardrails(
        sites={"sampler.token_ids": {"on_no_valid_token": "eos", "eos_token_id": 5000}}
    )
    with pytest.raises(ValueError, match=r"eos_token_id=5000 is outside the vocabulary \[0, 100\)"):
        guards.token_site("sampler.token_ids", vocab_size=100)
    guards.close()


def test_an_eos_token_id_outside_a_calls_vocabulary_leaves_the_ids_untouched() -> None:
    guards = fresh_guardrails(
        sites={"sampler.token_ids": {"on_no_valid_token": "eos", "eos_token_id": 150}}
    )
    guards.site("sampler.logits")(torch.full((1, 4), NAN))
    site = guards.token_site("sampler.token_ids", vocab_size=1000)
    ids = torch.tensor([0])
    with pytest.raises(ValueError, match=r"eos_token_id=150 is outside the vocabulary \[0, 100\)"):
        site(ids, 100)
    assert ids.tolist() == [0]  # guardrails never writes an id the engine cannot embed
    guards.close()


@pytest.fixture
def default_instance() -> Iterator[None]:
    reset_default()
    yield
    reset_default()


def test_sanitize_logits_takes_sglangs_call_with_a_message(default_instance: None) -> None:
    x = torch.tensor([[NAN, 1.0]])
    # How SGLang's sampler calls sanitize_nan_logits: the message is not a site name.
    flags = gr.sanitize_logits_(x, "sampler: next_token_logits")
    assert flags is not None
    assert flags.tolist() == [int(RowFlag.NAN)]
    assert x.tolist() == [[-math.inf, 1.0]]
    assert gr.default().count("sampler.logits", "nan") == 1


def test_sanitize_logits_still_takes_a_site_by_keyword(default_instance: None) -> None:
    gr.sanitize_logits_(torch.tensor([[NAN, 1.0]]), site="eagle.verify")
    assert gr.default().count("eagle.verify", "nan") == 1


ENGINE = """
def first(ids, logits):
    return ids


def second(ids, logits):
    return ids
"""


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = ModuleType("corners_engine")
    exec(textwrap.dedent(ENGINE), module.__dict__)
    monkeypatch.setitem(sys.modules, "corners_engine", module)
    return module


def test_one_token_site_at_two_targets_checks_each_against_its_own_vocabulary(
    engine: ModuleType,
) -> None:
    from prometheus_client import CollectorRegistry

    token_point = {
        "site": "sampler.token_ids",
        "kind": "token_ids",
        "tensor": "arg:ids",
        "vocab_size_from": "arg:logits",
    }
    registry = CollectorRegistry()
    guards = fresh_guardrails(
        attach=[
            {**token_point, "target": "corners_engine:first"},
            {**token_point, "target": "corners_engine:second"},
        ],
        registry=registry,
        logger=SilentLogger(),
    )
    assert [h.state for h in guards.attach_configured()] == ["applied", "applied"]
    big, small = torch.tensor([5, 150]), torch.tensor([5, 150])
    engine.first(big, torch.zeros(2, 1000))
    engine.second(small, torch.zeros(2, 100))
    assert big.tolist() == [5, 150]  # valid in [0, 1000)
    assert small.tolist() == [5, 0]  # 150 is outside [0, 100)
    assert guards.count("sampler.token_ids", "rows_oob_token") == 1
    unguarded = registry.get_sample_value(
        "guardrails_guard_errors_total",
        {"site": "sampler.token_ids", "reason": "reference", "rank": "0"},
    )
    assert unguarded == 0.0  # no call went on unguarded
    guards.close()
