"""Every wrapper guardrails puts on code it does not own is `guardrails.attach.wrapping.around`,
installed by `ImportPatch`: attach points, the heartbeat, loaders and engine hook parts alike.
A hook part is a plain function marked with its handle, put back by `.remove()`, and its own
host time leaves out the engine's call inside it."""

from __future__ import annotations

import ast
import inspect
import time
from pathlib import Path
from typing import Any

import pytest

import guardrails
from guardrails.attach.patching import ImportPatch
from guardrails.integrations._hooks import MethodHook
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path

HOOK = "vllm.end_poisoned_requests"
ENGINE = (
    "import time\n"
    "class Runner:\n"
    "    def step(self, x, pause=0.0):\n"
    "        time.sleep(pause)\n"
    "        return x + 1\n"
    "    async def handle(self, x):\n"
    "        return x * 2\n"
)


def through(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    assert isinstance(instance, object)
    return wrapped(*args, **kwargs)


def test_a_hook_part_is_the_one_wrapper_marked_with_its_handle_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guards = fresh_guardrails()
    with module_on_path(ENGINE, "one_wrapper_engine", tmp_path, monkeypatch) as name:
        module = __import__(name)
        original = module.Runner.__dict__["step"]
        part = MethodHook(guards, HOOK, name, "Runner.step", through)
        part.install()
        assert isinstance(part, ImportPatch)
        assert part.state == "applied"
        wrapper = module.Runner.__dict__["step"]
        assert inspect.isfunction(wrapper)  # no proxy object: what callers test for holds
        assert wrapper.__guardrails_patch__ is part
        assert wrapper.__wrapped__ is original
        assert module.Runner().step(1) == 2
        assert part.calls == 1
        part.remove()
        assert module.Runner.__dict__["step"] is original
        assert part.state == "removed"


def test_a_hook_part_on_an_async_def_stays_a_coroutine_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    async def awaiting(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return await wrapped(*args, **kwargs) + 1

    guards = fresh_guardrails()
    with module_on_path(ENGINE, "one_wrapper_async", tmp_path, monkeypatch) as name:
        module = __import__(name)
        part = MethodHook(guards, HOOK, name, "Runner.handle", awaiting)
        part.install()
        assert inspect.iscoroutinefunction(module.Runner.handle)
        assert asyncio.run(module.Runner().handle(3)) == 7
        part.remove()


def test_a_hook_parts_host_time_leaves_out_the_engines_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's call sleeps 0.4 s; the part's own work is a function call: its time is
    far below the engine's (a wide margin, not a speed check)."""
    guards = fresh_guardrails()
    with module_on_path(ENGINE, "one_wrapper_timed", tmp_path, monkeypatch) as name:
        module = __import__(name)
        part = MethodHook(guards, HOOK, name, "Runner.step", through)
        part.install()
        started = time.perf_counter()
        assert module.Runner().step(1, pause=0.4) == 2
        assert time.perf_counter() - started >= 0.4
        spent = guards.host_time.spent[f"hook:{HOOK}"]
        assert 0 < spent < 0.2
        part.remove()


def test_nothing_in_the_package_wraps_foreign_code_another_way() -> None:
    """No wrapt function wrapper, no `functools.wraps` wrapper outside `around` (tracing's
    forward of its own traced classes aside), no `partial` bound as a method."""
    root = Path(guardrails.__file__).parent
    allowed = {root / "attach" / "wrapping.py", root / "tracing" / "tracer.py"}
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in (
                "wrap_function_wrapper",
                "FunctionWrapper",
                "ObjectProxy",
            ):
                found.append(f"{path.relative_to(root)}: {node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "wraps" and path not in allowed:
                found.append(f"{path.relative_to(root)}: functools.wraps")
            get = isinstance(node, ast.FunctionDef) and node.name == "__get__"
            if get and "partial" in ast.unparse(node):
                found.append(f"{path.relative_to(root)}: partial in __get__")
    assert found == []
