"""Import-path patching against a real module written to disk and imported for real."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from guardrails.attach.points import AttachError
from guardrails.service import Guardrails
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path

ENGINE = '''
import torch


class Sampler:
    def forward(self, logits, sampling_info=None):
        return logits.argmax(-1)

    def preprocess(self, logits, info=None):
        """Reports what it was given: guarded arguments arrive healed."""
        return bool(torch.isnan(logits).any())

    def passthrough(self, logits):
        return logits

    def pair(self, logits):
        return logits, logits.argmax(-1)

    @staticmethod
    def static_prep(logits):
        return logits

    @classmethod
    def class_prep(cls, logits):
        return logits


class FastSampler(Sampler):
    pass


class Output:
    def __init__(self, logits):
        self.next_token_logits = logits


def verify(batch, output, *, page_size=1):
    return bool(torch.isnan(output.next_token_logits).any())


def sample(logits, vocab_size, *rest):
    return torch.tensor([0, vocab_size + 3])


TABLE = {"not": "callable"}
'''


@pytest.fixture
def engine_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, not yet imported module on sys.path."""
    with module_on_path(ENGINE, "fake_engine", tmp_path, monkeypatch) as name:
        yield name


@pytest.fixture
def engine(engine_name: str) -> ModuleType:
    return importlib.import_module(engine_name)


def nan_logits(rows: int = 2, vocab: int = 8) -> torch.Tensor:
    logits = torch.randn(rows, vocab)
    logits[0, 3] = float("nan")
    return logits


def test_patch_applies_at_once_when_the_module_is_imported(
    guards: Guardrails, engine: ModuleType
) -> None:
    handle = guards.patch(f"{engine.__name__}:Sampler.passthrough", "sampler.logits")
    engine.Sampler().passthrough(nan_logits())
    assert handle.state == "applied"
    assert guards.count("sampler.logits", "nan") == 1


def test_patch_of_a_module_never_imported_stays_pending(
    guards: Guardrails, engine_name: str
) -> None:
    handle = guards.patch(f"{engine_name}:Sampler.passthrough", "sampler.logits")
    assert handle.state == "pending"
    assert guards.patches() == [handle]
    assert engine_name not in sys.modules


def test_pending_patch_applies_when_the_module_is_imported(
    guards: Guardrails, engine_name: str
) -> None:
    handle = guards.patch(f"{engine_name}:Sampler.passthrough", "sampler.logits")
    engine = importlib.import_module(engine_name)
    engine.Sampler().passthrough(nan_logits())
    assert handle.state == "applied"
    assert guards.count("sampler.logits", "nan") == 1


def test_patching_twice_wraps_once(guards: Guardrails, engine: ModuleType) -> None:
    target = f"{engine.__name__}:Sampler.passthrough"
    first = guards.patch(target, "sampler.logits")
    second = guards.patch(target, "sampler.logits")
    engine.Sampler().passthrough(nan_logits())
    assert second is first
    assert guards.count("sampler.logits", "calls") == 1


def test_remove_restores_the_original_attribute(guards: Guardrails, engine: ModuleType) -> None:
    original = engine.Sampler.__dict__["passthrough"]
    handle = guards.patch(f"{engine.__name__}:Sampler.passthrough", "sampler.logits")
    handle.remove()
    assert engine.Sampler.__dict__["passthrough"] is original
    assert handle.state == "removed"
    assert guards.patches() == []


def test_remove_of_an_inherited_method_deletes_the_override(
    guards: Guardrails, engine: ModuleType
) -> None:
    with guards.patch(f"{engine.__name__}:FastSampler.passthrough", "sampler.logits"):
        assert "passthrough" in engine.FastSampler.__dict__
        engine.Sampler().passthrough(nan_logits())  # the base class is not patched
    assert "passthrough" not in engine.FastSampler.__dict__
    assert guards.count("sampler.logits", "calls") == 0


def test_remove_under_someone_elses_wrapper_stops_guarding_and_keeps_theirs(
    guards: Guardrails, engine: ModuleType
) -> None:
    handle = guards.patch(f"{engine.__name__}:Sampler.passthrough", "sampler.logits")
    ours = engine.Sampler.passthrough
    calls: list[int] = []

    def theirs(self: Any, logits: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return ours(self, logits)

    engine.Sampler.passthrough = theirs
    handle.remove()
    engine.Sampler().passthrough(nan_logits())
    assert engine.Sampler.passthrough is theirs
    assert calls == [1]
    assert guards.count("sampler.logits", "calls") == 0


def test_argument_by_name_is_healed_before_the_callee_sees_it(
    guards: Guardrails, engine: ModuleType
) -> None:
    guards.patch(f"{engine.__name__}:Sampler.preprocess", "sampler.logits", tensor="arg:logits")
    assert engine.Sampler().preprocess(nan_logits()) is False
    assert engine.Sampler().preprocess(logits=nan_logits()) is False
    assert guards.count("sampler.logits", "nan") == 2


def test_argument_positions_count_after_self(guards: Guardrails, engine: ModuleType) -> None:
    guards.patch(f"{engine.__name__}:Sampler.preprocess", "sampler.logits", tensor="arg:0")
    assert engine.Sampler().preprocess(nan_logits(), None) is False


def test_argument_attribute_path_is_followed(guards: Guardrails, engine: ModuleType) -> None:
    guards.patch(f"{engine.__name__}:verify", "eagle.verify", tensor="arg:output.next_token_logits")
    assert engine.verify(None, engine.Output(nan_logits()), page_size=1) is False


def test_return_tuple_element_is_guarded(guards: Guardrails, engine: ModuleType) -> None:
    guards.patch(f"{engine.__name__}:Sampler.pair", "sampler.logits", tensor="return:0")
    logits, _ = engine.Sampler().pair(nan_logits())
    assert not bool(torch.isnan(logits).any())


@pytest.mark.parametrize("method", ["static_prep", "class_prep"])
def test_static_and_class_methods_stay_what_they_were(
    guards: Guardrails, engine: ModuleType, method: str
) -> None:
    kind = type(engine.Sampler.__dict__[method])
    guards.patch(f"{engine.__name__}:Sampler.{method}", "sampler.logits", tensor="arg:logits")
    out = getattr(engine.Sampler, method)(nan_logits())
    assert type(engine.Sampler.__dict__[method]) is kind
    assert not bool(torch.isnan(out).any())


def test_token_ids_take_their_vocab_size_from_an_argument(
    guards: Guardrails, engine: ModuleType
) -> None:
    guards.patch(
        f"{engine.__name__}:sample",
        "sampler.token_ids",
        kind="token_ids",
        vocab_size_from="arg:vocab_size",
    )
    ids = engine.sample(None, 10)
    assert ids.tolist() == [0, 0]  # 13 is outside [0, 10): replaced with replacement_id
    assert guards.count("sampler.token_ids", "oob_token") == 1


def test_token_ids_with_a_fixed_vocab_size(guards: Guardrails, engine: ModuleType) -> None:
    guards.patch(f"{engine.__name__}:sample", "sampler.token_ids", kind="token_ids", vocab_size=5)
    engine.sample(None, 1)  # returns [0, 4]: inside [0, 5)
    assert guards.count("sampler.token_ids", "oob_token") == 0
    assert guards.count("sampler.token_ids", "calls") == 1


@pytest.mark.parametrize(
    ("qualname", "tensor", "expected"),
    [
        ("Sampler.nope", "return", "has no attribute 'nope'"),
        ("Nope.forward", "return", "has no attribute 'Nope'"),
        ("TABLE", "return", "is not callable"),
        ("Sampler.preprocess", "arg:nope", "has no argument 'nope' (its arguments: logits, info)"),
        ("Sampler.preprocess", "arg:2", "arg:2 is out of range"),
        ("sample", "arg:rest", "not *rest"),
        ("Sampler.preprocess", "arg:self", "has no argument 'self'"),
    ],
)
def test_a_target_that_does_not_fit_is_an_error_naming_it(
    guards: Guardrails, engine: ModuleType, qualname: str, tensor: str, expected: str
) -> None:
    target = f"{engine.__name__}:{qualname}"
    with pytest.raises(AttachError, match=r"attach target='(.*)'") as caught:
        guards.patch(target, "sampler.logits", tensor=tensor)
    assert target in str(caught.value)
    assert expected in str(caught.value)


def test_a_pending_target_that_does_not_fit_fails_the_import(
    guards: Guardrails, engine_name: str
) -> None:
    handle = guards.patch(f"{engine_name}:Sampler.nope", "sampler.logits")
    with pytest.raises(AttachError, match="has no attribute 'nope'"):
        importlib.import_module(engine_name)
    assert handle.state == "failed"


def test_a_reference_that_does_not_fit_the_call_leaves_that_call_unguarded(
    guards: Guardrails, engine: ModuleType
) -> None:
    # Not an error raised from the engine's call: counted and logged (test_guard_errors.py).
    guards.patch(f"{engine.__name__}:Sampler.passthrough", "sampler.logits", tensor="return.nope")
    logits = nan_logits()
    assert engine.Sampler().passthrough(logits) is logits
    assert bool(logits.isnan().any())
    assert guards.count("sampler.logits", "calls") == 0


def test_a_disabled_site_leaves_the_target_untouched(engine: ModuleType) -> None:
    guards = fresh_guardrails(disabled_sites=("sampler.logits",))
    original = engine.Sampler.__dict__["passthrough"]
    handle = guards.patch(f"{engine.__name__}:Sampler.passthrough", "sampler.logits")
    assert handle.state == "disabled"
    assert engine.Sampler.__dict__["passthrough"] is original
    guards.close()


def test_a_second_instance_cannot_guard_the_same_point(
    guards: Guardrails, engine: ModuleType
) -> None:
    target = f"{engine.__name__}:Sampler.passthrough"
    guards.patch(target, "sampler.logits")
    other = fresh_guardrails()
    with pytest.raises(AttachError, match="another Guardrails instance"):
        other.patch(target, "sampler.logits")
    other.close()


def test_config_entries_are_applied_with_their_origin(engine: ModuleType) -> None:
    entry = {"site": "sampler.logits", "target": f"{engine.__name__}:Sampler.passthrough"}
    guards = fresh_guardrails(attach=[entry])
    (handle,) = guards.attach_configured()
    engine.Sampler().passthrough(nan_logits())
    assert handle.state == "applied"
    assert handle.point.origin == "argument attach[0].target"
    assert guards.count("sampler.logits", "nan") == 1
    guards.close()


def test_bad_arguments_to_patch_are_config_errors_naming_the_argument(guards: Guardrails) -> None:
    with pytest.raises(ValueError, match=r"argument target.*not an import path"):
        guards.patch("os.system", "sampler.logits")
