"""Attach helpers in code: the `guard_output` decorator and `attach_module` forward hooks,
their handles, and what they do to the tensors they guard."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import guardrails as gr


def test_decorator_guards_the_returned_logits(guards: gr.Guardrails) -> None:
    @guards.guard_output("sampler.logits")
    def compute(rows: int) -> torch.Tensor:
        return torch.full((rows, 4), math.nan)

    assert compute.__name__ == "compute"
    assert bool((compute(2) == 0).all())
    compute.remove()
    assert bool(compute(2).isnan().all())


def test_decorated_method_binds_self(guards: gr.Guardrails) -> None:
    class Head:
        scale = 2.0

        @guards.guard_output("sampler.logits")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    out = Head().forward(torch.tensor([[1.0, math.inf]]))
    assert out.tolist() == [[2.0, pytest.approx(1e30, rel=1e-6)]]


def test_decorator_handle_is_a_context_manager(guards: gr.Guardrails) -> None:
    def compute() -> torch.Tensor:
        return torch.full((1, 4), math.nan)

    with guards.guard_output("sampler.logits")(compute) as guarded:
        assert bool((guarded() == 0).all())
    assert bool(guarded().isnan().all())


def test_module_hook_guards_outputs_until_removed(guards: gr.Guardrails) -> None:
    head = nn.Linear(4, 8)
    with torch.no_grad():
        head.bias[3] = math.inf
    handle = guards.attach_module(head, "model.logits")
    out = head(torch.zeros(2, 4))
    assert not bool(torch.isinf(out).any())
    assert guards.count("model.logits", "posinf") == 2
    handle.remove()
    handle.remove()  # idempotent
    assert bool(torch.isinf(head(torch.zeros(2, 4))).any())


def test_module_hook_as_context_manager_and_with_output_objects(guards: gr.Guardrails) -> None:
    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": x.clone(), "other": x}

    model = Model()
    with guards.attach_module(model, "model.logits"):
        out = model(torch.full((1, 3), math.nan))
        assert bool((out["logits"] == 0).all())
    assert bool(model(torch.full((1, 3), math.nan))["logits"].isnan().all())


def test_module_hook_with_select(guards: gr.Guardrails) -> None:
    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[int, torch.Tensor]:
            return 0, x.clone()

    model = Model()
    guards.attach_module(model, "model.logits", select=lambda out: out[1])
    assert bool((model(torch.full((1, 3), math.nan))[1] == 0).all())


def test_decorator_guards_what_an_async_function_returns(guards: gr.Guardrails) -> None:
    """An `async def` (an async engine's sampler step): the call returns a coroutine, and the
    logits are guarded once it is awaited, as a config attach point on the same function
    does (it raised "cannot find logits in a coroutine" and left the coroutine unawaited)."""
    import asyncio
    import inspect

    class Sampler:
        @guards.guard_output("sampler.logits")
        async def step(self, value: float) -> torch.Tensor:
            await asyncio.sleep(0)
            return torch.tensor([[0.5, value, 1.0]])

    sampler = Sampler()
    pending = sampler.step(math.nan)
    assert inspect.iscoroutine(pending)
    out = asyncio.run(pending)
    assert float(out[0, 1]) == -math.inf
    assert guards.count("sampler.logits", "nan") == 1
    assert inspect.iscoroutinefunction(Sampler.step)
    assert inspect.iscoroutinefunction(sampler.step)
    Sampler.step.remove()  # type: ignore[attr-defined]
    assert math.isnan(float(asyncio.run(sampler.step(math.nan))[0, 1]))


def test_guard_input_heals_the_argument_before_the_call_sync_async_and_generator(
    guards: gr.Guardrails,
) -> None:
    """`guard_input` wraps with the same `around` as attach points: the callee sees healed
    logits whether it is a plain function, a method, an `async def` or a generator function."""
    import asyncio
    import inspect

    seen: list[float] = []

    class Sampler:
        @guards.guard_input("sampler.logits")
        def step(self, logits: torch.Tensor) -> None:
            seen.append(float(logits[0, 1]))

        @guards.guard_input("sampler.logits", arg="scores")
        async def astep(self, scores: torch.Tensor) -> None:
            await asyncio.sleep(0)
            seen.append(float(scores[0, 1]))

        @guards.guard_input("sampler.logits")
        def stream(self, logits: torch.Tensor) -> Iterator[float]:
            yield float(logits[0, 1])

    sampler = Sampler()
    sampler.step(torch.tensor([[0.5, math.nan]]))
    asyncio.run(sampler.astep(scores=torch.tensor([[0.5, math.nan]])))
    assert inspect.isgeneratorfunction(Sampler.stream.__wrapped__)  # type: ignore[attr-defined]
    seen.extend(sampler.stream(torch.tensor([[0.5, math.nan]])))
    assert seen == [-math.inf] * 3
    assert guards.count("sampler.logits", "nan") == 3
    assert inspect.iscoroutinefunction(sampler.astep)
    Sampler.step.remove()  # type: ignore[attr-defined]
    sampler.step(torch.tensor([[0.5, math.nan]]))
    assert math.isnan(seen[-1])


def test_decorators_refuse_what_they_cannot_guard_at_decoration(guards: gr.Guardrails) -> None:
    def stream() -> Iterator[torch.Tensor]:
        yield torch.zeros(1, 2)

    with pytest.raises(TypeError, match="generator function"):
        guards.guard_output("sampler.logits")(stream)

    def step(scores: torch.Tensor) -> None:
        return None

    with pytest.raises(ValueError, match=r"no argument 'logits' \(scores\)"):
        guards.guard_input("sampler.logits")(step)


def test_decorator_counts_its_own_host_time_apart_from_the_site(guards: gr.Guardrails) -> None:
    @guards.guard_output("sampler.logits")
    def compute() -> torch.Tensor:
        return torch.zeros(2, 4)

    compute()
    spent = guards.host_time.spent
    assert spent["attach:sampler.logits"] > 0
