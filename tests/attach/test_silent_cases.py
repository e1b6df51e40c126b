"""Configurations that used to leave a site unguarded without a word: each now works, or is an
error at attach time (fatal under `strict_attach`) and in `guardrails check`.

1. two `[[attach]]` entries for one target, site and tensor differing only in `when` (or the
   vocabulary);
2. a `when` whose distribution has no metadata (an engine imported from a source checkout);
3. an engine hook half whose module never comes (tests/attach/test_liveness.py and the check
   tests below);
4. `abort_on` that no configured hook acts on;
5. an `async def` target (and generator functions);
6. `guardrails run --config RELATIVE.toml` with a child started in another directory.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from guardrails.attach.points import AttachError
from guardrails.exceptions import ConfigError
from guardrails.testing import SilentLogger, fresh_guardrails
from tests.attach.modules import module_on_path
from tests.processes import ROOT, child_env

ENGINE = """
__version__ = "{version}"


class Sampler:
    def forward(self, logits, vocab_size=None):
        return logits.argmax(-1)

    def ids(self, logits, ids):
        return ids

    async def aforward(self, logits):
        return logits

    async def aseen(self, logits):
        return logits.clone()  # what the body saw

    def stream(self, logits):
        yield logits.argmax(-1)

    async def astream(self, logits):
        yield logits
"""
NAN_ROW = [[float("nan"), 1.0]]


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    source = ENGINE.format(version="0.5.20")
    with module_on_path(source, "silent_engine", tmp_path, monkeypatch) as name:
        yield importlib.import_module(name)


def entry(engine: ModuleType, target: str, **fields: Any) -> dict[str, Any]:
    return {"site": "sampler.logits", "target": f"{engine.__name__}:{target}", **fields}


# -- 1. one value, two points ---------------------------------------------------------------


def test_a_point_for_another_version_no_longer_hides_its_twin(engine: ModuleType) -> None:
    guards = fresh_guardrails(
        attach=[
            entry(engine, "Sampler.forward", tensor="arg:logits", when="torch<0.1"),
            entry(engine, "Sampler.forward", tensor="arg:logits", when="torch>=1"),
        ],
        logger=SilentLogger(),
    )
    old, new = guards.attach_configured()
    assert (old.state, new.state) == ("inapplicable", "applied")
    logits = torch.tensor(NAN_ROW)
    engine.Sampler().forward(logits)
    assert logits.tolist() == [[float("-inf"), 1.0]]
    guards.close()


def test_token_points_differing_only_in_their_vocabulary_are_two_points(
    engine: ModuleType,
) -> None:
    guards = fresh_guardrails(
        attach=[
            entry(
                engine,
                "Sampler.ids",
                site="sampler.token_ids",
                kind="token_ids",
                tensor="arg:ids",
                vocab_size_from="arg:logits",
                when="torch<0.1",
            ),
            entry(
                engine,
                "Sampler.ids",
                site="sampler.token_ids",
                kind="token_ids",
                tensor="arg:ids",
                vocab_size=4,
            ),
        ],
        logger=SilentLogger(),
    )
    assert [h.state for h in guards.attach_configured()] == ["inapplicable", "applied"]
    ids = torch.tensor([1, 9])
    engine.Sampler().ids(torch.zeros(2, 100), ids)
    assert ids.tolist() == [1, 0]  # checked against vocab_size = 4
    guards.close()


def test_two_applicable_points_for_one_value_are_an_attach_error(engine: ModuleType) -> None:
    guards = fresh_guardrails(
        attach=[
            entry(engine, "Sampler.forward", tensor="arg:logits", when="torch>=1"),
            entry(engine, "Sampler.forward", tensor="arg:logits", when="torch>=2"),
        ],
        logger=SilentLogger(),
    )
    first, second = guards.attach_configured()
    assert (first.state, second.state) == ("applied", "failed")
    assert "already guarded at 'sampler.logits' by argument attach[0]" in str(second.error)
    engine.Sampler().forward(torch.tensor(NAN_ROW))
    assert guards.count("sampler.logits", "calls") == 1  # guarded once, not twice
    guards.close()


def test_two_applicable_points_for_one_value_are_fatal_with_strict_attach(
    engine: ModuleType,
) -> None:
    guards = fresh_guardrails(
        attach=[
            entry(engine, "Sampler.forward", tensor="arg:logits"),
            entry(engine, "Sampler.forward", tensor="arg:logits", when="torch>=1"),
        ],
        strict_attach=True,
    )
    with pytest.raises(AttachError, match="two points for one value"):
        guards.attach_configured()
    guards.close()


# -- 2. `when` without distribution metadata ------------------------------------------------


@pytest.mark.parametrize(
    ("version", "when", "state"),
    [
        ("0.5.20", ">=0.5.14", "applied"),
        ("0.5.20", "<0.5.14", "inapplicable"),
    ],
)
def test_when_falls_back_to_the_modules_own_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, when: str, state: str
) -> None:
    # A source checkout on PYTHONPATH: importable, no distribution metadata of that name.
    source = ENGINE.format(version=version)
    with module_on_path(source, "checkout_engine", tmp_path, monkeypatch) as name:
        importlib.import_module(name)
        guards = fresh_guardrails(
            attach=[
                {"site": "sampler.logits", "target": f"{name}:Sampler.forward", "when": name + when}
            ],
            logger=SilentLogger(),
        )
        (handle,) = guards.attach_configured()
        assert handle.state == state
        guards.close()


def test_a_when_that_cannot_be_checked_is_an_attach_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = ENGINE.replace('__version__ = "{version}"', "")
    with module_on_path(source, "checkout_engine", tmp_path, monkeypatch) as name:
        importlib.import_module(name)
        guards = fresh_guardrails(
            attach=[
                {
                    "site": "sampler.logits",
                    "target": f"{name}:Sampler.forward",
                    "when": f"{name}>=1",
                }
            ],
            logger=SilentLogger(),
        )
        (handle,) = guards.attach_configured()
        assert handle.state == "failed"
        assert "cannot be checked" in str(handle.error)
        assert "no distribution metadata" in str(handle.error)
        site, target, _ = guards.attach_errors.failures[0]
        assert (site, target) == ("sampler.logits", f"{name}:Sampler.forward")
        guards.close()
        strict = fresh_guardrails(
            attach=[
                {
                    "site": "sampler.logits",
                    "target": f"{name}:Sampler.forward",
                    "when": f"{name}>=1",
                }
            ],
            strict_attach=True,
        )
        with pytest.raises(AttachError, match="cannot be checked"):
            strict.attach_configured()
        strict.close()


# -- 4. abort_on that nothing acts on -------------------------------------------------------


def test_abort_on_that_no_hook_acts_on_is_an_attach_error_under_install_hooks(
    engine: ModuleType,
) -> None:
    guards = fresh_guardrails(
        attach=[entry(engine, "Sampler.forward", tensor="arg:logits")],
        heartbeat=f"{engine.__name__}:Sampler.ids",
        sites={"sampler.logits": {"abort_on": ["no_valid_token"]}},
        logger=SilentLogger(),
    )
    guards.attach_configured()
    guards.install_hooks()
    site, target, error = guards.attach_errors.failures[-1]
    assert (site, target) == ("sampler.logits", "abort_on")
    assert "no configured hook acts on it" in error
    guards.close()


def test_abort_on_with_the_engines_hook_is_no_error() -> None:
    guards = fresh_guardrails(
        hooks=["vllm.end_poisoned_requests"],
        sites={"sampler.logits": {"abort_on": ["no_valid_token"]}},
        logger=SilentLogger(),
    )
    guards.install_hooks()
    assert guards.attach_errors.failures == []
    guards.close()


def test_abort_on_that_no_hook_acts_on_is_fatal_with_strict_attach() -> None:
    guards = fresh_guardrails(
        sites={"sampler.logits": {"abort_on": ["no_valid_token"]}}, strict_attach=True
    )
    with pytest.raises(ConfigError, match="no configured hook acts on it"):
        guards.install_hooks()
    guards.close()


def test_a_hook_with_nothing_to_act_on_is_a_warning() -> None:
    guards = fresh_guardrails(hooks=["sglang.abort_poisoned_requests"], logger=SilentLogger())
    [notice] = guards.settings.notices
    assert "hook sglang.abort_poisoned_requests ends nothing" in str(notice)
    guards.close()


# -- 5. coroutine and generator functions ----------------------------------------------------


def test_an_async_target_is_guarded_on_its_awaited_value(engine: ModuleType) -> None:
    guards = fresh_guardrails(
        attach=[entry(engine, "Sampler.aforward", tensor="return")], logger=SilentLogger()
    )
    (handle,) = guards.attach_configured()
    assert handle.state == "applied"
    assert inspect.iscoroutinefunction(engine.Sampler.aforward)
    out = asyncio.run(engine.Sampler().aforward(torch.tensor(NAN_ROW)))
    assert out.tolist() == [[float("-inf"), 1.0]]
    assert guards.count("sampler.logits", "nan") == 1
    assert guards.count("sampler.logits", "calls") == 1
    guards.close()


def test_an_async_target_guards_its_argument_before_its_body_runs(engine: ModuleType) -> None:
    guards = fresh_guardrails(
        attach=[entry(engine, "Sampler.aseen", tensor="arg:logits")], logger=SilentLogger()
    )
    guards.attach_configured()
    seen = asyncio.run(engine.Sampler().aseen(torch.tensor(NAN_ROW)))
    assert seen.tolist() == [[float("-inf"), 1.0]]
    assert guards.count("sampler.logits", "nan") == 1
    guards.close()


@pytest.mark.parametrize(
    ("target", "tensor", "message"),
    [
        ("Sampler.stream", "return", "is a generator function"),
        ("Sampler.astream", "arg:logits", "is an async generator function"),
    ],
)
def test_generator_targets_that_cannot_be_guarded_are_attach_errors(
    engine: ModuleType, target: str, tensor: str, message: str
) -> None:
    guards = fresh_guardrails(attach=[entry(engine, target, tensor=tensor)], logger=SilentLogger())
    (handle,) = guards.attach_configured()
    assert handle.state == "failed"
    assert message in str(handle.error)
    guards.close()


def test_a_generator_target_guards_its_argument_and_stays_a_generator(
    engine: ModuleType,
) -> None:
    guards = fresh_guardrails(
        attach=[entry(engine, "Sampler.stream", tensor="arg:logits")], logger=SilentLogger()
    )
    guards.attach_configured()
    assert inspect.isgeneratorfunction(engine.Sampler.stream)
    logits = torch.tensor(NAN_ROW)
    assert [t.tolist() for t in engine.Sampler().stream(logits)] == [[1]]
    assert guards.count("sampler.logits", "nan") == 1
    guards.close()


# -- 6. a relative config path, a child in another directory --------------------------------


def test_a_relative_config_reaches_a_child_started_in_another_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "guardrails.toml").write_text("sanitize = false\n", encoding="utf-8")
    code = (
        "from guardrails.integrations.launcher import installed; "
        "print(installed().settings.sanitize, installed().settings.config_file)"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    child = f"cd {elsewhere} && exec {sys.executable} -c '{code}'"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "guardrails",
            "run",
            "--config",
            "guardrails.toml",
            "--",
            "sh",
            "-c",
            child,
        ],
        cwd=work,
        env={**child_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", str(work / "guardrails.toml")]


def test_a_relative_config_variable_is_made_absolute_for_the_command(tmp_path: Path) -> None:
    from guardrails.integrations.launcher import prepare

    (tmp_path / "g.toml").write_text("", encoding="utf-8")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        env, settings = prepare({"GUARDRAILS_CONFIG_FILE": "g.toml"})
    finally:
        os.chdir(cwd)
    assert env["GUARDRAILS_CONFIG_FILE"] == str(tmp_path / "g.toml")
    assert settings.config_file == tmp_path / "g.toml"
