"""A bad tensor reaching a patched target: counted, logged once, and the engine's call goes on.

Under zero-code attach the engine never chose to call guardrails, so a tensor the site refuses
(a dtype it does not accept, no vocab dimension, a sparse or meta tensor, memory that overlaps
itself) or a reference that does not fit the call must not raise from the engine's call, let
alone end the process under `guardrails run`. It is counted in
`guardrails_guard_errors_total{site, reason, rank}`, logged once per (site, reason) as
`guardrails.guard_error`, and that call proceeds unguarded. Real modules written to disk and
imported; the launcher tests start a real `guardrails run` process.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.names import GUARD_ERROR_EVENT
from guardrails.reporting.metrics import GUARD_ERROR_REASONS
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path
from tests.attach.test_launcher import PY, launch

ENGINE = """
def sample(logits):
    return logits


class Output:
    def __init__(self, logits):
        self.logits = logits


def forward(logits):
    return Output(logits)


def pick(logits, vocab_size):
    return logits
"""

SITE = "sampler.logits"


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    with module_on_path(ENGINE, "guard_error_engine", tmp_path, monkeypatch) as name:
        yield importlib.import_module(name)


def _errors(registry: CollectorRegistry, reason: str, site: str = SITE) -> float | None:
    return registry.get_sample_value(
        "guardrails_guard_errors_total", {"site": site, "reason": reason, "rank": "0"}
    )


def _sparse() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.full((2, 4), math.nan).to_sparse()


# (what reaches the target, the reason it is counted under)
BAD_TENSORS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "float32": (lambda: torch.full((2, 4), math.nan), "dtype"),
    "float8": (lambda: torch.zeros(2, 4).to(torch.float8_e4m3fn), "dtype"),
    "zero_dim": (lambda: torch.tensor(math.nan, dtype=torch.bfloat16), "shape"),
    "overlapping": (
        lambda: torch.full((1, 8), math.nan, dtype=torch.bfloat16).expand(3, 8),
        "layout",
    ),
    "sparse": (lambda: _sparse().to(torch.bfloat16), "layout"),
    "meta": (lambda: torch.zeros(2, 4, dtype=torch.bfloat16, device="meta"), "device"),
}


@pytest.mark.parametrize("case", BAD_TENSORS, ids=str)
def test_a_bad_tensor_is_counted_logged_once_and_the_engines_call_proceeds(
    engine: ModuleType, case: str
) -> None:
    make, reason = BAD_TENSORS[case]
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, sites={SITE: {"dtypes": ["bfloat16"]}})
    guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
    with capture_logs() as logs:
        for _ in range(3):
            bad = make()
            assert engine.sample(bad) is bad  # no exception; the callee got its argument
    assert _errors(registry, reason) == 3
    events = [e for e in logs if e["event"] == GUARD_ERROR_EVENT]
    assert len(events) == 1
    (event,) = events
    assert event["log_level"] == "error"
    assert (event["site"], event["reason"], event["rank"]) == (SITE, reason, "0")
    assert event["target"] == f"{engine.__name__}:sample"
    # A good tensor afterwards is guarded as usual.
    good = torch.tensor([[math.nan, 1.0]], dtype=torch.bfloat16)
    engine.sample(good)
    assert good.tolist() == [[-math.inf, 1.0]]
    assert guards.count(SITE, "nan") == 1
    assert guards.count(SITE, "calls") == 1  # refused calls are not guarded calls
    guards.close()


def test_a_refused_tensor_reaches_the_engine_untouched(engine: ModuleType) -> None:
    guards = fresh_guardrails(sites={SITE: {"dtypes": ["bfloat16"]}})
    guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
    x = torch.full((1, 2459), math.nan, dtype=torch.bfloat16).expand(2, 2459)
    engine.sample(x)
    assert bool(x.isnan().all())
    guards.close()


def test_a_reference_that_does_not_fit_the_call_is_counted_as_reference(
    engine: ModuleType,
) -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    guards.patch(f"{engine.__name__}:forward", SITE, tensor="return.nope")
    with capture_logs() as logs:
        out = engine.forward(torch.zeros(2, 4))
        engine.forward(torch.zeros(2, 4))
    assert isinstance(out, engine.Output)
    assert _errors(registry, "reference") == 2
    (event,) = [e for e in logs if e["event"] == GUARD_ERROR_EVENT]
    assert event["tensor"] == "return.nope"
    assert "has no attribute 'nope'" in event["error"]
    guards.close()


def test_a_vocab_size_that_cannot_be_read_is_counted_as_reference(engine: ModuleType) -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    guards.patch(
        f"{engine.__name__}:pick",
        "sampler.token_ids",
        tensor="arg:logits",
        kind="token_ids",
        vocab_size_from="arg:vocab_size",
    )
    ids = torch.tensor([1, 2])
    assert engine.pick(ids, "not a size") is ids
    assert _errors(registry, "reference", site="sampler.token_ids") == 1
    guards.close()


def test_any_other_error_of_the_guard_is_counted_as_error(engine: ModuleType) -> None:
    # 2**45 rows of an empty vocabulary: no memory for the tensor, 32 TiB for its row flags.
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
    huge = torch.empty(2**45, 0)
    with capture_logs() as logs:
        assert engine.sample(huge) is huge
    assert _errors(registry, "error") == 1
    (event,) = [e for e in logs if e["event"] == GUARD_ERROR_EVENT]
    assert event["error"].startswith("RuntimeError")
    guards.close()


def test_in_async_assert_mode_the_sites_assert_still_fails_the_call(engine: ModuleType) -> None:
    # CI mode: the process must fail where the bad value is; on the CPU the assert raises.
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, async_assert=True)
    guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
    with pytest.raises(RuntimeError, match="GUARDRAILS_ASYNC_ASSERT"):
        engine.sample(torch.full((2, 4), math.nan))
    engine.sample(torch.tensor(math.nan))  # a refused tensor is still only counted
    assert _errors(registry, "shape") == 1
    guards.close()


def test_every_reason_exists_at_zero_once_a_point_is_applied(engine: ModuleType) -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
    assert [_errors(registry, reason) for reason in GUARD_ERROR_REASONS] == [0.0] * len(
        GUARD_ERROR_REASONS
    )
    guards.close()


def test_another_instance_logs_its_own_first_error(engine: ModuleType) -> None:
    for _ in range(2):
        guards = fresh_guardrails(sites={SITE: {"dtypes": ["bfloat16"]}})
        handle = guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
        with capture_logs() as logs:
            engine.sample(torch.zeros(2, 4))
        assert [e["reason"] for e in logs if e["event"] == GUARD_ERROR_EVENT] == ["dtype"]
        handle.remove()
        guards.close()


def test_a_failing_logger_or_registry_never_reaches_the_engine(engine: ModuleType) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Callable[..., None]:
            def fail(*args: object, **kwargs: object) -> None:
                raise RuntimeError("logging is down")

            return fail

    guards = fresh_guardrails(logger=Broken(), sites={SITE: {"dtypes": ["bfloat16"]}})
    guards.patch(f"{engine.__name__}:sample", SITE, tensor="arg:logits")
    x = torch.zeros(2, 4)
    assert engine.sample(x) is x
    guards.close()


# -- under `guardrails run` ------------------------------------------------------------------

CHILD = """
import torch
from prometheus_client import REGISTRY
from guardrails.integrations.launcher import installed
import launched_engine

def good():
    return torch.tensor([[float("nan"), 1.0]], dtype=torch.bfloat16)

launched_engine.sample(good())
bad = {
    "float32": torch.zeros(2, 4),
    "float8": torch.zeros(2, 4).to(torch.float8_e4m3fn),
    "zero_dim": torch.tensor(1.0, dtype=torch.bfloat16),
}
for name, tensor in bad.items():
    try:
        out = launched_engine.sample(tensor)
        print("result", name, "returned", out is tensor, flush=True)
    except Exception as exc:
        print("result", name, "raised", type(exc).__name__, flush=True)
healed = good()
launched_engine.sample(healed)
print("result healed", healed.tolist())
guards = installed()
counts = [guards.count("sampler.logits", kind) for kind in ("nan", "calls")]
print("result counts", *counts)
for reason in ("dtype", "shape"):
    labels = {"site": "sampler.logits", "reason": reason, "rank": "0"}
    value = REGISTRY.get_sample_value("guardrails_guard_errors_total", labels)
    print("result errors", reason, value)
"""


def test_under_guardrails_run_a_bad_tensor_never_ends_the_process(tmp_path: Path) -> None:
    (tmp_path / "launched_engine.py").write_text(
        "def sample(logits):\n    return logits\n", encoding="utf-8"
    )
    config = tmp_path / "guardrails.toml"
    config.write_text(
        '[sites."sampler.logits"]\ndtypes = ["bfloat16"]\n\n'
        '[[attach]]\nsite = "sampler.logits"\ntarget = "launched_engine:sample"\n'
        'tensor = "arg:logits"\n',
        encoding="utf-8",
    )
    proc = launch(PY, "-c", CHILD, env={"PYTHONPATH": str(tmp_path)}, config=config)
    assert proc.returncode == 0, proc.stderr
    results = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("result")]
    assert results == [
        ["float32", "returned", "True"],
        ["float8", "returned", "True"],
        ["zero_dim", "returned", "True"],
        ["healed", "[[-inf,", "1.0]]"],
        ["counts", "2", "2"],
        ["errors", "dtype", "2.0"],
        ["errors", "shape", "1.0"],
    ]
    assert "exiting (status 2)" not in proc.stderr
