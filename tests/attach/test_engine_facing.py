"""What the real-engine profiles need of attach points, on a real module imported for real:
a vocabulary read at every call, points for some engine versions only, attach failures that
never stop the process, engine hooks, and poisoned rows ended with EOS at the token site."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from guardrails.attach.points import AttachError
from guardrails.flags import RowFlag
from guardrails.names import KNOWN_HOOKS
from guardrails.service import Guardrails
from guardrails.testing import SilentLogger, fresh_guardrails
from tests.attach.modules import module_on_path

ENGINE = '''
import torch


class Sampler:
    def __init__(self):
        self.seen = []

    def preprocess(self, logits):
        return logits

    def forward(self, logits, vocab_size):
        """Samples greedily from what preprocess returns, as engines' samplers do."""
        logits = self.preprocess(logits)
        self.seen.append(logits.clone())
        return logits.argmax(-1)


def ids_for(ids, vocab_size):
    return ids
'''

TORCH = importlib.metadata.version("torch")


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    with module_on_path(ENGINE, "facing_engine", tmp_path, monkeypatch) as name:
        yield importlib.import_module(name)


def configured(engine: ModuleType, attach: list[dict[str, Any]], **settings: Any) -> Guardrails:
    for entry in attach:
        entry["target"] = entry["target"].format(engine=engine.__name__)
    return fresh_guardrails(attach=attach, logger=SilentLogger(), **settings)


# -- vocab_size_from at every call ----------------------------------------------------------


def test_the_vocabulary_is_read_at_every_call(engine: ModuleType) -> None:
    guards = configured(
        engine,
        [
            {
                "site": "sampler.token_ids",
                "kind": "token_ids",
                "target": "{engine}:ids_for",
                "tensor": "return",
                "vocab_size_from": "arg:vocab_size",
            }
        ],
    )
    guards.attach_configured()
    assert engine.ids_for(torch.tensor([999, 5]), 1000).tolist() == [999, 5]
    # The vocabulary grew (a second model, an added adapter): 4321 is valid now, 9000 is not.
    assert engine.ids_for(torch.tensor([4321, 9000]), 8000).tolist() == [4321, 0]
    # And shrank again: 999 is out of vocab for a 500-token model.
    assert engine.ids_for(torch.tensor([999, 7]), 500).tolist() == [0, 7]
    assert guards.count("sampler.token_ids", "oob_token") == 2
    guards.close()


def test_a_vocabulary_the_replacement_id_does_not_fit_leaves_that_call_unguarded(
    engine: ModuleType,
) -> None:
    guards = configured(
        engine,
        [
            {
                "site": "sampler.token_ids",
                "kind": "token_ids",
                "target": "{engine}:ids_for",
                "vocab_size_from": "arg:vocab_size",
            }
        ],
        sites={"sampler.token_ids": {"replacement_id": 50}},
    )
    guards.attach_configured()
    assert engine.ids_for(torch.tensor([170]), 100).tolist() == [50]
    assert engine.ids_for(torch.tensor([70]), 20).tolist() == [70]  # not rewritten to 50
    registry = guards.guard_errors._registry
    assert (
        registry.get_sample_value(
            "guardrails_guard_errors_total",
            {"site": "sampler.token_ids", "reason": "reference", "rank": "0"},
        )
        == 1.0
    )
    guards.close()


# -- `when`: points for some versions only -----------------------------------------------


@pytest.mark.parametrize(
    ("when", "state"),
    [
        (f"torch=={TORCH}", "applied"),
        ("torch<0.1", "inapplicable"),
        ("torch>=999", "inapplicable"),
        # Imported, yet no metadata and no __version__ to check it against: an error, never
        # a point silently switched off (tests/attach/test_silent_cases.py).
        ("no-such-distribution-here>=1", "failed"),
        (None, "applied"),
    ],
)
def test_a_point_applies_only_to_the_versions_it_names(
    engine: ModuleType, when: str | None, state: str
) -> None:
    entry: dict[str, Any] = {"site": "sampler.logits", "target": "{engine}:Sampler.preprocess"}
    if when is not None:
        entry["when"] = when
    guards = configured(engine, [entry])
    (handle,) = guards.attach_configured()
    assert handle.state == state
    logits = torch.tensor([[float("nan"), 1.0]])
    engine.Sampler().forward(logits, 2)
    assert bool(torch.isnan(logits).any()) is (state != "applied")
    guards.close()


def test_version_aware_alternatives_guard_exactly_once(engine: ModuleType) -> None:
    # The profile pattern: the same site at one target for old versions, another for new.
    guards = configured(
        engine,
        [
            {"site": "sampler.logits", "target": "{engine}:Sampler.preprocess", "when": "torch<1"},
            {
                "site": "sampler.logits",
                "target": "{engine}:Sampler.forward",
                "tensor": "arg:logits",
                "when": "torch>=1",
            },
        ],
    )
    old, new = guards.attach_configured()
    assert (old.state, new.state) == ("inapplicable", "applied")
    engine.Sampler().forward(torch.tensor([[float("nan"), 1.0]]), 2)
    assert guards.count("sampler.logits", "calls") == 1
    guards.close()


# -- attach failures never stop the process -------------------------------------------------


def test_a_point_that_does_not_fit_is_counted_and_the_others_still_guard(
    engine: ModuleType,
) -> None:
    guards = configured(
        engine,
        [
            {"site": "eagle.verify", "target": "{engine}:Verifier.verify"},  # not in this version
            {"site": "sampler.logits", "target": "{engine}:Sampler.preprocess"},
        ],
    )
    failed, applied = guards.attach_configured()  # no raise
    assert (failed.state, applied.state) == ("failed", "applied")
    assert isinstance(failed.error, AttachError)
    assert "has no attribute 'Verifier'" in str(failed.error)
    logits = torch.tensor([[float("nan"), 1.0]])
    engine.Sampler().forward(logits, 2)
    assert logits.tolist() == [[float("-inf"), 1.0]]
    registry = guards.guard_errors._registry
    value = registry.get_sample_value(
        "guardrails_attach_errors_total",
        {"site": "eagle.verify", "target": f"{engine.__name__}:Verifier.verify", "rank": "0"},
    )
    assert value == 1.0
    assert guards.attach_errors.failures[0][:2] == (
        "eagle.verify",
        f"{engine.__name__}:Verifier.verify",
    )
    guards.close()


def test_strict_attach_raises_the_point_that_does_not_fit(engine: ModuleType) -> None:
    guards = configured(
        engine,
        [{"site": "eagle.verify", "target": "{engine}:Verifier.verify"}],
        strict_attach=True,
    )
    with pytest.raises(AttachError, match="has no attribute 'Verifier'"):
        guards.attach_configured()
    guards.close()


# -- engine hooks -----------------------------------------------------------------------

_installed: list[Guardrails] = []


class _Handle:
    state = "applied"

    def remove(self) -> None:
        self.state = "removed"


def install_test_hook(guards: Guardrails) -> list[_Handle]:
    _installed.append(guards)
    return [_Handle()]


def install_broken_hook(guards: Guardrails) -> list[_Handle]:
    raise RuntimeError("this engine version has no such scheduler")


@pytest.fixture
def test_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KNOWN_HOOKS, "test.ok", f"{__name__}:install_test_hook")  # type: ignore[index]
    monkeypatch.setitem(KNOWN_HOOKS, "test.broken", f"{__name__}:install_broken_hook")  # type: ignore[index]


@pytest.mark.usefixtures("test_hooks")
def test_configured_hooks_are_installed_and_a_broken_one_is_counted() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(
        environ={"GUARDRAILS_HOOKS": "test.broken, test.ok"},
        registry=registry,
        logger=SilentLogger(),
    )
    (handle,) = guards.install_hooks()
    assert handle.state == "applied"
    assert _installed[-1] is guards
    value = registry.get_sample_value(
        "guardrails_attach_errors_total",
        {"site": "test.broken", "target": f"{__name__}:install_broken_hook", "rank": "0"},
    )
    assert value == 1.0
    guards.close()


@pytest.mark.usefixtures("test_hooks")
def test_a_broken_hook_is_raised_under_strict_attach() -> None:
    guards = fresh_guardrails(hooks=["test.broken"], strict_attach=True, logger=SilentLogger())
    with pytest.raises(RuntimeError, match="no such scheduler"):
        guards.install_hooks()
    guards.close()


def test_an_unknown_hook_is_a_settings_error_naming_the_known_ones() -> None:
    from guardrails.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r"unknown hook 'vllm\.nope'"):
        fresh_guardrails(environ={"GUARDRAILS_HOOKS": "vllm.nope"})


# -- recent flags and on_no_valid_token = "eos" ----------------------------------------------


def test_recent_flags_are_the_latest_call_of_this_thread(guards: Guardrails) -> None:
    site = guards.site("sampler.logits")
    assert site.recent_flags() is None
    site(torch.tensor([[1.0, 2.0], [float("nan"), float("nan")]]))
    first = site.recent()
    assert first is not None
    assert first[1].tolist() == [0, int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)]
    site(torch.tensor([[float("inf"), 0.0]]))
    second = site.recent()
    assert second is not None
    assert second[0] > first[0]
    assert second[1].tolist() == [int(RowFlag.POSINF)]

    import threading

    seen: list[object] = []
    worker = threading.Thread(target=lambda: seen.append(site.recent_flags()))
    worker.start()
    worker.join()
    assert seen == [None]  # another thread has made no call


def eos_guards(engine: ModuleType) -> Guardrails:
    return configured(
        engine,
        [
            {"site": "sampler.logits", "target": "{engine}:Sampler.preprocess"},
            {
                "site": "sampler.token_ids",
                "kind": "token_ids",
                "target": "{engine}:Sampler.forward",
                "vocab_size_from": "arg:vocab_size",
            },
        ],
        sites={"sampler.token_ids": {"on_no_valid_token": "eos", "eos_token_id": 2}},
    )


def test_a_row_with_no_valid_token_ends_with_eos(engine: ModuleType) -> None:
    guards = eos_guards(engine)
    guards.attach_configured()
    nan = float("nan")
    logits = torch.tensor(
        [
            [0.0, 5.0, 1.0, 0.0],  # clean: argmax 1
            [nan, nan, nan, nan],  # poisoned: would sample the uniform row's id 0
            [nan, 1.0, 0.0, 9.0],  # healed: argmax 3, the request goes on
            [float("-inf")] * 4,  # nothing left to sample
        ]
    )
    ids = engine.Sampler().forward(logits, 4)
    assert ids.tolist() == [1, 2, 3, 2]
    site = guards.sites["sampler.token_ids"]
    flags = site.recent_flags()
    assert flags is not None
    assert flags.tolist() == [0, int(RowFlag.NO_VALID_TOKEN), 0, int(RowFlag.NO_VALID_TOKEN)]
    guards.close()


def test_eos_never_reuses_an_older_steps_flags(engine: ModuleType) -> None:
    guards = eos_guards(engine)
    guards.attach_configured()
    sampler = engine.Sampler()
    sampler.forward(torch.full((1, 4), float("nan")), 4)
    # The token site called again without a new logits call (another code path sampled):
    # the poisoned step's flags are not applied to this one.
    ids = engine.ids_for(torch.tensor([3]), 4)
    site = guards.sites["sampler.token_ids"]
    assert site(ids).tolist() == [0]
    assert ids.tolist() == [3]
    guards.close()


def test_eos_needs_an_eos_token_id() -> None:
    from guardrails.exceptions import ConfigError

    with pytest.raises(ConfigError, match="needs eos_token_id"):
        fresh_guardrails(sites={"sampler.token_ids": {"on_no_valid_token": "eos"}})
