"""What a hook part reads from an engine, declared and verified (`guardrails.attach.expects`),
and a part whose engine lacks it: never applied, reported once, marked off, the engine's
method left as it is. The engine here is a module written to disk and imported for real."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails import Guardrails, GuardSettings
from guardrails.attach.expects import calls, reads, verify
from guardrails.integrations._hooks import MethodHook
from guardrails.names import ATTACH_ERROR_EVENT, SITE_NOT_CALLED_EVENT

from .modules import module_on_path

ENGINE = """
import dataclasses
from typing import NamedTuple


@dataclasses.dataclass
class Output:
    req_ids: list
    sampled: list
    nans: dict | None = None


class Batch(NamedTuple):
    num_reqs: int


class Scheduler:
    limit = 8

    def __init__(self):
        self.requests = {}
        self.kv: "object | None" = None

    @property
    def size(self):
        return len(self.requests)

    def update(self, scheduler_output, runner_output, *, extra=None):
        return runner_output.sampled
"""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with module_on_path(ENGINE, "expects_engine", tmp_path, monkeypatch) as name:
        yield name


def test_fields_attributes_and_parameters_that_exist_hold(engine: str) -> None:
    assert (
        verify(
            [
                reads(f"{engine}:Output", "req_ids", "sampled", "nans"),  # dataclass fields
                reads(f"{engine}:Batch", "num_reqs"),  # a NamedTuple field
                reads(f"{engine}:Scheduler", "requests", "kv", "limit", "size", "update"),
                calls(f"{engine}:Scheduler.update", "scheduler_output", "runner_output"),
                calls(f"{engine}:Scheduler.update", "scheduler_output"),
                calls(f"{engine}:Scheduler.update"),
            ]
        )
        == []
    )


def test_a_missing_field_is_named_with_its_class(engine: str) -> None:
    assert verify([reads(f"{engine}:Output", "req_ids", "req_id_to_index")]) == [
        f"{engine}:Output has no field or attribute 'req_id_to_index'"
    ]


def test_an_attribute_only_compared_on_self_is_not_taken_for_an_assignment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = "class A:\n    def f(self):\n        return self.ready == 1\n"
    with module_on_path(source, "expects_cmp", tmp_path, monkeypatch) as name:
        assert verify([reads(f"{name}:A", "ready")]) == [
            f"{name}:A has no field or attribute 'ready'"
        ]


def test_a_missing_or_renamed_parameter_is_named(engine: str) -> None:
    [problem] = verify([calls(f"{engine}:Scheduler.update", "scheduler_output", "output")])
    assert problem == (
        f"{engine}:Scheduler.update takes (scheduler_output, runner_output), "
        "expected (scheduler_output, output) first"
    )


def test_a_missing_class_or_module_is_a_problem_never_an_exception(engine: str) -> None:
    assert verify([reads(f"{engine}:Gone", "x")]) == [f"{engine} has no attribute 'Gone'"]
    [problem] = verify([reads("no_such_engine_module.sub:Output", "x")])
    assert problem.startswith("no_such_engine_module.sub:Output: ModuleNotFoundError")


def test_the_installed_version_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from guardrails.settings import targets

    (tmp_path / "expects_dist").mkdir()
    (tmp_path / "expects_dist" / "__init__.py").write_text("class Output:\n    a = 1\n")
    info = tmp_path / "expects_dist-2.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: expects-dist\nVersion: 2.0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    targets._module_owners.cache_clear()
    try:
        assert verify([reads("expects_dist:Output", "b")]) == [
            "expects_dist:Output has no field or attribute 'b' (expects_dist 2.0.0)"
        ]
    finally:
        targets._module_owners.cache_clear()


# -- a hook part whose engine lacks what it reads ------------------------------------------


@pytest.fixture
def guards(registry: CollectorRegistry) -> Iterator[Guardrails]:
    with Guardrails(GuardSettings(environ={}), registry=registry) as built:
        yield built


def _part(guards: Guardrails, engine: str, *fields: str) -> tuple[MethodHook, list[int]]:
    seen: list[int] = []

    def half(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        seen.append(1)
        return wrapped(*args, **kwargs)

    part = MethodHook(
        guards,
        "test.hook",
        engine,
        "Scheduler.update",
        half,
        reads=[reads(f"{engine}:Output", *fields)],
    )
    return part, seen


def _step(engine: str) -> Any:
    import importlib

    module = importlib.import_module(engine)
    return module.Scheduler().update(None, module.Output(["r0"], [[7]]))


def test_a_part_whose_reads_hold_is_applied(guards: Guardrails, engine: str) -> None:
    part, seen = _part(guards, engine, "req_ids", "sampled")
    part.install()
    assert _step(engine) == [[7]]
    assert (part.state, seen) == ("applied", [1])
    part.remove()


def test_a_part_whose_engine_lacks_a_read_is_off_reported_once_and_never_called(
    guards: Guardrails, engine: str, registry: CollectorRegistry
) -> None:
    part, seen = _part(guards, engine, "req_ids", "req_id_to_index")
    with capture_logs() as logs:
        part.install()
        for _ in range(3):
            assert _step(engine) == [[7]]  # the engine's own method, unhooked
    assert (part.state, seen) == ("mismatch", [])
    labels = {"site": "test.hook", "target": f"{engine}:Scheduler.update", "rank": "0"}
    assert registry.get_sample_value("guardrails_attach_errors_total", labels) == 1.0
    off = {"site": "test.hook:Scheduler.update", "rank": "0"}
    assert registry.get_sample_value("guardrails_site_not_called", off) == 1.0
    [error] = [e for e in logs if e["event"] == ATTACH_ERROR_EVENT]
    assert "reads" in error["error"]
    assert "req_id_to_index" in error["error"]
    [silent] = [e for e in logs if e["event"] == SITE_NOT_CALLED_EVENT]
    assert silent["state"] == ["mismatch"]
    assert "lacks what it reads" in silent["action"]
    assert [e for e in logs if e["event"] == "guardrails.hook_error"] == []
    assert part.inspect() == [f"{engine}:Output has no field or attribute 'req_id_to_index'"]


# -- an attach point's reference past the call's own value ---------------------------------

ANNOTATED = """
import dataclasses
from typing import Optional


@dataclasses.dataclass
class Output:
    sampled_token_ids: list
    logits: object = None


class Sampler:
    def __call__(self, logits: Output, other: "Optional[Output]" = None) -> Output:
        return logits

    def pair(self) -> tuple[Output, int]:
        return Output([]), 1

    def bare(self, logits):
        return logits
"""


@pytest.mark.parametrize(
    ("method", "ref", "problem"),
    [
        ("__call__", "return.sampled_token_ids", None),
        ("__call__", "return.req_id_to_index", "return.req_id_to_index"),
        ("__call__", "arg:logits.logits", None),
        ("__call__", "arg:0.gone", "arg:0.gone"),
        ("__call__", "arg:other.gone", "arg:other.gone"),  # Optional[Output]
        ("pair", "return:0.logits", None),
        ("pair", "return:0.gone", "return:0.gone"),
        ("__call__", "return", None),  # nothing read past the value
        ("bare", "return.anything", None),  # no annotation: nothing can be told
    ],
)
def test_a_references_field_is_checked_against_the_annotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, ref: str, problem: str | None
) -> None:
    import importlib

    from guardrails.attach.expects import ref_problems
    from guardrails.settings.targets import parse_ref

    with module_on_path(ANNOTATED, "expects_annotated", tmp_path, monkeypatch) as name:
        func = getattr(importlib.import_module(name).Sampler, method)
        found = ref_problems(func, 1, parse_ref(ref))
    if problem is None:
        assert found == []
    else:
        attr = ref.rpartition(".")[2]
        assert found == [f"{problem}: {name}:Output has no field or attribute {attr!r}"]


def test_a_host_handler_may_call_back_into_the_part_while_its_mismatch_is_reported(
    engine: str, registry: CollectorRegistry
) -> None:
    """The mismatch is logged after the part's own lock is released: a host handler that
    removes the part from inside the event (as host code may call back into guardrails)
    does not deadlock the import that reported it."""
    import importlib
    import threading

    parts: list[MethodHook] = []
    seen: list[str] = []

    class CallingBack:
        def error(self, event: str, **fields: Any) -> None:
            seen.append(event)
            if event == ATTACH_ERROR_EVENT:
                parts[0].remove()

        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    with Guardrails(GuardSettings(environ={}), registry=registry, logger=CallingBack()) as guards:
        part, _ = _part(guards, engine, "req_ids", "req_id_to_index")
        parts.append(part)

        def install_and_import() -> None:
            part.install()
            importlib.import_module(engine)  # the post-import hook applies it here

        installing = threading.Thread(target=install_and_import, daemon=True)
        installing.start()
        installing.join(timeout=30)
        assert not installing.is_alive(), "the import's report deadlocked on the part's lock"
        assert ATTACH_ERROR_EVENT in seen
        assert part.state == "removed"
