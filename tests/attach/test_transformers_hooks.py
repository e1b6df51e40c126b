"""`transformers.end_poisoned_requests` on transformers' own `generate()` and continuous batching
(`generate_batch`, the engine `transformers serve --continuous-batching` runs), in process,
with the tiny float16 Llama that overflows by itself on its trigger word (tests/tiny_llama.py).
The served version of the same is `make e2e` (tests/e2e/), on the transformers it pins.

The serve layer's halves differ by version (their `when`): those of the version the installed
transformers is run on its own classes (from 5.25: the model process's runners); those of the
other run on a restatement of that version's callers (before 5.25: `GenerateManager`,
`InferenceThread`, `CBGenerateManager`, with transformers' real `generate()` and batching).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

pytest.importorskip("transformers")

from guardrails import Guardrails, GuardSettings
from guardrails.integrations._hooks import MethodHook
from guardrails.integrations.transformers_hooks import (
    HOOK,
    MESSAGE,
    PoisonedRequestError,
    _ServedKwargs,
    end_poisoned_requests,
)
from guardrails.settings.targets import requirement_holds
from tests import tiny_llama

PROFILE = Path(__file__).resolve().parents[2] / "config" / "profiles" / "transformers-serve.toml"
CLEAN = [[4, 33, 75, 88], [60, 12, 140, 9, 30], [101, 7, 55]]
POISONED = [4, len(tiny_llama.SPECIALS) + tiny_llama.WORDS.index(tiny_llama.TRIGGER), 75, 88]
NEW = 10


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama.build_model()


def aborted(registry: Any, reason: str = "nonfinite_logits") -> Any:
    """guardrails_requests_aborted_total of the profile's hook."""
    return registry.get_sample_value(
        "guardrails_requests_aborted_total", {"hook": HOOK, "reason": reason, "rank": "0"}
    )


@pytest.fixture
def profile(registry: Any) -> Iterator[Guardrails]:
    guards = Guardrails(
        GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}), registry=registry
    )
    handles = [*guards.attach_configured(), *guards.install_hooks()]
    # Every generation half applies at once; the serve layer's wait for transformers.cli.serving
    # (a test here may import it), or are off for another transformers version than this one.
    for hook in guards.hooks():
        if hook.when is None:
            assert hook.state == "applied", hook
        elif requirement_holds(hook.when):
            assert hook.state in ("pending", "applied"), hook
        else:
            assert hook.state == "inapplicable", hook
    yield guards
    for handle in handles:
        handle.remove()
    guards.close()


class Streamer:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def _generate(model: Any, ids: list[int], streamer: Any = None, **kwargs: Any) -> torch.Tensor:
    return model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=NEW,
        streamer=streamer,
        **kwargs,
    )


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_generate_raises_before_the_poisoned_token_is_streamed(
    model: Any, profile: Guardrails, do_sample: bool
) -> None:
    streamer = Streamer()
    with pytest.raises(PoisonedRequestError, match="no valid token"):
        _generate(model, POISONED, streamer, do_sample=do_sample)
    assert streamer.puts == [POISONED]  # the prompt, and no sampled token
    assert not streamer.ended
    assert profile.count("sampler.logits", "rows_no_valid_token") == 1
    assert profile.count("sampler.logits", "nan") == tiny_llama.VOCAB


def test_generate_without_a_streamer_raises_too(model: Any, profile: Guardrails) -> None:
    with pytest.raises(PoisonedRequestError) as raised:
        _generate(model, POISONED, do_sample=False)
    assert str(raised.value) == MESSAGE


def test_an_ended_generate_is_counted_and_named_by_its_streamers_request_id(
    model: Any, profile: Guardrails, registry: Any
) -> None:
    streamer = Streamer()
    streamer.request_id = 7003  # type: ignore[attr-defined]  # what transformers serve's carries
    with capture_logs() as logs:
        with pytest.raises(PoisonedRequestError):
            _generate(model, POISONED, streamer, do_sample=False)
        with pytest.raises(PoisonedRequestError):
            _generate(model, POISONED, do_sample=False)  # a bare generate(): no id
    ended = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert [(e["request_id"], e["hook"], e["site"], e["reason"]) for e in ended] == [
        ("7003", HOOK, "sampler.logits", "nonfinite_logits"),
        (None, HOOK, "sampler.logits", "nonfinite_logits"),
    ]
    assert aborted(registry) == 2.0


def test_clean_generate_is_unchanged_under_the_hook(model: Any) -> None:
    unguarded = _generate(model, CLEAN[0], do_sample=False)
    from prometheus_client import CollectorRegistry

    guards = Guardrails(
        GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}),
        registry=CollectorRegistry(),
    )
    handles = [*guards.attach_configured(), *guards.install_hooks()]
    try:
        guarded = _generate(model, CLEAN[0], do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
        guards.close()
    assert torch.equal(guarded, unguarded)
    assert guards.count("sampler.logits", "nan") == 0


def _batch(model: Any, inputs: list[list[int]]) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=tiny_llama.EOS)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    outputs = model.generate_batch(
        inputs, generation_config=config, continuous_batching_config=cb, progress_bar=False
    )
    return {  # request ids are req_0, req_1, ... in input order
        key: outputs[key] for key in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))
    }


def test_batching_ends_the_poisoned_request_and_its_neighbours_match_their_solo_text(
    model: Any, profile: Guardrails, registry: Any
) -> None:
    alone = [next(iter(_batch(model, [ids]).values())).generated_tokens for ids in CLEAN]
    with capture_logs() as logs:
        results = list(_batch(model, [CLEAN[0], POISONED, CLEAN[1], CLEAN[2]]).values())
    poisoned = results[1]
    assert poisoned.error == MESSAGE
    assert poisoned.generated_tokens == []  # the token sampled from its healed row is dropped
    assert [r.error for r in results[:1] + results[2:]] == [None, None, None]
    assert [r.generated_tokens for r in results[:1] + results[2:]] == alone
    assert profile.count("sampler.logits", "rows_no_valid_token") == 1
    assert aborted(registry) == 1.0
    [ended] = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert (ended["request_id"], ended["status"]) == ("req_1", 500)


def test_unguarded_batching_lets_the_poison_reach_the_neighbours(model: Any) -> None:
    # What the hook is for: in the same batch, the clean requests' logits go NaN (greedy
    # argmax then picks id 0, the pad token) through the shared attention call.
    alone = [next(iter(_batch(model, [ids]).values())).generated_tokens for ids in CLEAN]
    results = list(_batch(model, [CLEAN[0], POISONED, CLEAN[1], CLEAN[2]]).values())
    clean = [r.generated_tokens for r in results[:1] + results[2:]]
    assert clean != alone
    assert any(tiny_llama.PAD in tokens for tokens in clean)


# The serve layer's halves, by the transformers serve they are for.
ONE_PROCESS = {  # before 5.25
    "CBGenerateManager.generate_non_streaming",
    "GenerateManager.generate_streaming",
    "GenerateManager.generate_non_streaming",
    "InferenceThread.submit",
    "InferenceThread.async_submit",
}
MODEL_PROCESS = {  # from 5.25: the API server's, then the model process's
    "ChatCompletionHandler.handle_request",
    "CompletionHandler.handle_request",
    "ResponseHandler.handle_request",
    "EngineClient._send_request",
    "GenerateRunner.generate",
    "CBGenerateRunner.generate",
}


@pytest.mark.parametrize(
    ("version", "serving"),
    [("5.24.0", ONE_PROCESS), ("5.25.0.dev0", MODEL_PROCESS), ("5.25.0", MODEL_PROCESS)],
)
def test_each_version_gets_the_serve_halves_of_its_serve(
    version: str, serving: set[str], registry: Any
) -> None:
    hooks = end_poisoned_requests(Guardrails(GuardSettings(environ={}), registry=registry))
    applied = {h.target for h in hooks if h.when is not None and requirement_holds(h.when, version)}
    assert applied == serving
    assert all(h.when is None for h in hooks if h.target not in ONE_PROCESS | MODEL_PROCESS)


def _defines(module: str, target: str) -> bool:
    """Whether the installed transformers' source of `module` defines `Owner.method` (read, not
    imported: serve's handler modules import the server packages)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    owner, method = target.split(".")
    for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
        if isinstance(node, ast.ClassDef) and node.name == owner:
            functions = (ast.FunctionDef, ast.AsyncFunctionDef)
            return any(isinstance(f, functions) and f.name == method for f in node.body)
    return False


def test_the_installed_transformers_defines_the_targets_of_its_halves_and_not_the_others(
    registry: Any,
) -> None:
    """Each gated part's target exists where its `when` holds; serve 5.24's classes are gone
    from 5.25 on (5.24 already had the request handlers 5.25's parts wrap, unused there)."""
    hooks = end_poisoned_requests(Guardrails(GuardSettings(environ={}), registry=registry))
    gated = [h for h in hooks if h.when is not None]
    found = {h.target: _defines(h.module, h.target) for h in gated}
    want = {h.target: True for h in gated if requirement_holds(h.when or "")}
    if requirement_holds("transformers>=5.25.0.dev0"):
        want.update({h.target: False for h in gated if h.when == "transformers<5.25.0.dev0"})
    assert {target: found[target] for target in want} == want
    assert len(want) >= 5


# -- transformers serve before 5.25, restated: its callers of generate() and of the batch ------


class InferenceThread:
    """transformers 5.24.0's `InferenceThread` (cli/serving/utils.py), restated: every job
    submitted runs on one thread of its own."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, args, kwargs, future, loop = self._queue.get()
            try:
                result = fn(*args, **kwargs)
                if loop is not None:
                    loop.call_soon_threadsafe(future.set_result, result)
                else:
                    future.set_result(result)
            except Exception as e:
                if loop is not None:
                    loop.call_soon_threadsafe(future.set_exception, e)
                else:
                    future.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((fn, args, kwargs, future, None))
        return future

    def async_submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, args, kwargs, future, loop))
        return future


class GenerateManager:
    """transformers 5.24.0's `GenerateManager`, restated: what its handlers' calls hand to the
    inference thread (a stream's error event carries `str(error)`; returned here)."""

    def __init__(self) -> None:
        self._thread = InferenceThread()

    def generate_streaming(
        self, model: Any, processor: Any, inputs: dict[str, Any], gen_config: Any, request_id: str
    ) -> tuple[Future[Any], list[str]]:
        events: list[str] = []

        def _run() -> None:
            try:
                model.generate(**inputs, streamer=Streamer(), generation_config=gen_config)
            except Exception as e:
                events.append(str(e))

        return self._thread.submit(_run), events

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: dict[str, Any], gen_config: Any, request_id: str
    ) -> Any:
        return await self._thread.async_submit(
            model.generate, **inputs, generation_config=gen_config
        )


class CBGenerateManager:
    """transformers 5.24.0's `CBGenerateManager.generate_non_streaming`, restated: a request the
    batch failed is a RuntimeError naming it."""

    def __init__(self, model: Any, config: Any) -> None:
        from transformers import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
        self._cb = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=cb
        )
        self._cb.start()

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: dict[str, Any], gen_config: Any, request_id: str
    ) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._cb.register_result_handler(
            request_id, lambda result: loop.call_soon_threadsafe(future.set_result, result)
        )
        self._cb.add_request(
            inputs["input_ids"],
            request_id=request_id,
            max_new_tokens=gen_config.max_new_tokens,
            streaming=False,
            eos_token_id=gen_config.eos_token_id,
        )
        result = await future
        if result.error is not None:
            raise RuntimeError(f"CB generation failed for {request_id}: {result.error}")
        return result.generated_tokens

    def stop(self) -> None:
        self._cb.stop(block=True)


@pytest.fixture
def one_process_serve(profile: Guardrails) -> Iterator[None]:
    """The profile's halves for transformers serve before 5.25, on the restatement above (their
    version gate aside: the installed transformers may be another)."""
    halves = [h for h in end_poisoned_requests(profile) if h.target in ONE_PROCESS]
    hooks = [MethodHook(profile, HOOK, __name__, h.target, h._half) for h in halves]
    for hook in hooks:
        hook.install()
    assert [hook.state for hook in hooks] == ["applied"] * len(ONE_PROCESS)
    yield
    for hook in hooks:
        hook.remove()


def _config(**kwargs: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=NEW, do_sample=False, eos_token_id=tiny_llama.EOS, **kwargs
    )


def _inputs(ids: list[int]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }


def _named(logs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (e["request_id"], e["reason"], e["status"])
        for e in logs
        if e["event"] == "guardrails.request_aborted"
    ]


@pytest.mark.usefixtures("one_process_serve")
def test_before_5_25_plain_serve_ends_with_the_message_and_names_the_handlers_request_id(
    model: Any, registry: Any
) -> None:
    manager = GenerateManager()
    with capture_logs() as logs:
        with pytest.raises(PoisonedRequestError) as raised:
            asyncio.run(
                manager.generate_non_streaming(model, None, _inputs(POISONED), _config(), "r-524")
            )
        done, events = manager.generate_streaming(
            model, None, _inputs(POISONED), _config(), "s-524"
        )
        done.result(timeout=60)
        clean = asyncio.run(
            manager.generate_non_streaming(model, None, _inputs(CLEAN[0]), _config(), "c-524")
        )
    assert str(raised.value) == MESSAGE  # the JSON body's detail
    assert events == [MESSAGE]  # the stream's error event
    assert clean.shape[-1] == len(CLEAN[0]) + NEW
    assert [n[0] for n in _named(logs)] == ["r-524", "s-524"]
    assert aborted(registry) == 2.0


@pytest.mark.usefixtures("one_process_serve")
def test_before_5_25_batching_answers_its_failed_request_with_the_message(
    model: Any, registry: Any
) -> None:
    manager = CBGenerateManager(model, _config())
    try:
        with capture_logs() as logs:
            with pytest.raises(PoisonedRequestError) as raised:
                asyncio.run(
                    manager.generate_non_streaming(
                        model, None, {"input_ids": POISONED}, _config(), "b-524"
                    )
                )
            clean = asyncio.run(
                manager.generate_non_streaming(
                    model, None, {"input_ids": CLEAN[1]}, _config(), "k-524"
                )
            )
    finally:
        manager.stop()
    assert str(raised.value) == MESSAGE
    assert isinstance(raised.value.__cause__, RuntimeError)  # transformers' own, kept as cause
    assert len(clean) == NEW
    assert _named(logs) == [("b-524", "nonfinite_logits", 500)]


def test_before_5_25_another_batch_failure_is_left_as_transformers_raised_it() -> None:
    half = next(
        h._half
        for h in end_poisoned_requests(Guardrails(GuardSettings(environ={})))
        if h.target == "CBGenerateManager.generate_non_streaming"
    )
    failure = RuntimeError("CB generation failed for x: out of blocks")

    async def generate_non_streaming(*args: Any) -> Any:
        raise failure

    with pytest.raises(RuntimeError) as raised:
        asyncio.run(half(generate_non_streaming, None, (), {}))
    assert raised.value is failure


# -- transformers serve from 5.25: the model process's runners, transformers' own --------------

model_process = pytest.mark.skipif(
    not requirement_holds("transformers>=5.25.0.dev0"),
    reason="transformers serve runs the model in a process of its own from 5.25 on",
)


class Results:
    """What a runner sends the API server: each ended request's result, by its number."""

    def __init__(self) -> None:
        self.ended: dict[int, Any] = {}
        self._done = threading.Condition()

    def __call__(self, ids: list[int], tokens: list[int], finished: list[tuple[int, Any]]) -> None:
        with self._done:
            self.ended.update(finished)
            self._done.notify_all()

    def wait(self, *numbers: int) -> list[Any]:
        with self._done:
            assert self._done.wait_for(lambda: set(numbers) <= set(self.ended), timeout=120)
            return [self.ended[n] for n in numbers]


GENERATION_KWARGS = {  # what serve's handlers send, greedy (`BaseHandler._build_generation_kwargs`)
    "max_new_tokens": NEW,
    "eos_token_id": tiny_llama.EOS,
    "do_sample": False,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
}


@model_process
def test_from_5_25_plain_serve_names_each_ended_request_by_the_id_it_was_sent_with(
    model: Any, profile: Guardrails, registry: Any
) -> None:
    from transformers.cli.serving.utils import GenerateRunner

    results = Results()
    runner = GenerateRunner(model, tiny_llama.build_tokenizer(), results)
    with capture_logs() as logs:
        runner.generate(1, _inputs(POISONED), _ServedKwargs(GENERATION_KWARGS, "p-525"), False)
        runner.generate(2, _inputs(POISONED), _ServedKwargs(GENERATION_KWARGS, "s-525"), True)
        runner.generate(3, _inputs(POISONED), dict(GENERATION_KWARGS), False)  # sent unnamed
        runner.generate(4, _inputs(CLEAN[2]), _ServedKwargs(GENERATION_KWARGS, "c-525"), False)
        ended, streamed, unnamed, clean = results.wait(1, 2, 3, 4)
    # What crosses to the API server, as text: its `EngineClient` half raises it as ours.
    assert [str(e).endswith(MESSAGE) for e in (ended, streamed, unnamed)] == [True] * 3
    assert len(clean) == NEW
    assert [n[0] for n in _named(logs)] == ["p-525", "s-525", None]
    assert aborted(registry) == 3.0


def _end_outputs_thread(runner: Any) -> None:
    """transformers 5.25's `continuous-batching-outputs` thread keeps polling a stopped
    manager, whose `get_result` then returns at once: a loop holding the GIL for the rest of
    the test session (it slowed `make test`'s later modules several times over). The loop
    returns once the manager reports a fatal error: report one, and wait for the thread."""
    runner.manager.background_thread_status.fatal_error = RuntimeError("the test is over")
    for thread in threading.enumerate():
        if thread.name == "continuous-batching-outputs":
            thread.join(timeout=10)
            assert not thread.is_alive()


@model_process
def test_from_5_25_batching_names_its_failed_request_by_the_id_it_was_sent_with(
    model: Any, profile: Guardrails, registry: Any
) -> None:
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.utils import CBGenerateRunner

    results = Results()
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    runner = CBGenerateRunner(model, tiny_llama.build_tokenizer(), results, cb)
    try:
        with capture_logs() as logs:
            runner.generate(
                5, {"input_ids": CLEAN[0]}, _ServedKwargs(GENERATION_KWARGS, "k"), False
            )
            runner.generate(
                6, {"input_ids": POISONED}, _ServedKwargs(GENERATION_KWARGS, "b"), False
            )
            clean, failed = results.wait(5, 6)
    finally:
        runner.manager.stop(block=True)
        _end_outputs_thread(runner)
    assert isinstance(failed, RuntimeError)
    assert str(failed).endswith(MESSAGE)
    assert len(clean) == NEW
    assert _named(logs) == [("b", "nonfinite_logits", 500)]


def test_from_5_25_the_api_server_sends_the_handlers_id_and_answers_an_ended_request_as_ours(
    registry: Any,
) -> None:
    """`EngineClient._send_request(method, args, streamer=None)`'s half, on what transformers
    5.25's client does with the request (pickled onto a multiprocessing queue) and its end."""
    from multiprocessing.reduction import ForkingPickler

    [handler, client] = [
        h._half
        for h in end_poisoned_requests(Guardrails(GuardSettings(environ={}), registry=registry))
        if h.target in ("ChatCompletionHandler.handle_request", "EngineClient._send_request")
    ]
    sent: list[Any] = []

    async def send_request(method: str, args: tuple[Any, ...], streamer: Any = None) -> Any:
        sent.append(ForkingPickler.loads(ForkingPickler.dumps((method, 7, *args))))
        raise RuntimeError(
            f"ServedPoisonedRequestError: {MESSAGE}"
        )  # as the model's process ends it

    async def handle_request(body: dict[str, Any], request_id: str) -> Any:
        return await client(send_request, None, ("generate",), {"args": ({}, {"seed": None})})

    with pytest.raises(PoisonedRequestError) as raised:
        asyncio.run(handler(handle_request, None, ({}, "x-525"), {}))
    assert str(raised.value) == MESSAGE
    [(method, number, inputs, kwargs)] = sent
    assert (method, number, inputs, kwargs) == ("generate", 7, {}, {"seed": None})
    assert kwargs.request_id == "x-525"


# -- what each part declares it reads from transformers (guardrails.attach.expects) -----------


def test_every_part_declares_what_it_reads_and_it_holds_on_the_installed_transformers(
    registry: Any,
) -> None:
    """The parts of the installed transformers' version (their `when`), on its own classes: what
    each reads beyond its method's name is there (what `guardrails check` reports, and what
    decides whether a part is applied). The other version's parts: `guardrails check` there."""
    from transformers.utils import is_serve_available

    guards = Guardrails(
        GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}), registry=registry
    )
    parts = end_poisoned_requests(guards)
    assert [part.target for part in parts if not part.reads] == []
    checked = []
    for part in parts:
        if part.when is not None and not requirement_holds(part.when):
            continue
        try:
            problems = part.inspect()
        except ImportError:
            # serve's handler modules import the server packages (transformers[serving]).
            if part.module.startswith("transformers.cli.serving.") and not is_serve_available():
                continue
            raise
        assert problems == [], part
        checked.append(part.target)
    assert {part.target for part in parts if part.when is None} <= set(checked)
    assert all(part.state == "pending" for part in parts)  # inspected, nothing wrapped


def test_a_served_id_half_reads_the_position_its_part_declares_as_the_request_id(
    registry: Any,
) -> None:
    """`_ServedIdHalf(position)` takes the request id at `position` when it is not passed by
    name: the parameter its part declares there (both versions' parts, without importing)."""
    from guardrails.integrations.transformers_hooks import _ServedIdHalf

    parts = end_poisoned_requests(Guardrails(GuardSettings(environ={}), registry=registry))
    named = {
        part.target: part.reads[0].params[part._half._position]
        for part in parts
        if isinstance(part._half, _ServedIdHalf) and part.reads[0].params is not None
    }
    assert named == {
        "GenerateManager.generate_streaming": "request_id",
        "GenerateManager.generate_non_streaming": "request_id",
        "ChatCompletionHandler.handle_request": "request_id",
        "CompletionHandler.handle_request": "request_id",
        "ResponseHandler.handle_request": "request_id",
    }
