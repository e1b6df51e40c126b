"""The shipped profile on Model Runner V2, installed both ways in a child Python process:
through `guardrails run` (the bootstrap at interpreter start), and through vLLM's own plugin
loader (`vllm.plugins.load_general_plugins()`, which the child calls first, as
`EngineCore.__init__` and every worker do) with no launcher and no configuration. Under the
launcher the loader runs too and finds guardrails installed. The child steps V2's runner and
vLLM's scheduler (runner.py) with a poisoned request and a healable one.

The case issue 18 measured: before the profile had V2's points, this child's sampler calls
went through V2's `Sampler.__call__` with 0 guard calls and NaN logprobs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from guardrails.names import STARTED_EVENT
from tests.processes import json_events

from ..faults import PROFILE, VOCAB
from ..test_cli import BIN, ROOT, clean_env

CHILD = r"""
import json, pathlib, tempfile, torch
from vllm.plugins import load_general_plugins
load_general_plugins()  # as EngineCore.__init__ and WorkerWrapperBase.init_worker do
import vllm.v1.worker.cpu.shm  # as vLLM's CPU worker, before the V2 modules (conftest.py)
from guardrails.integrations.launcher import installed
from tests.engines.vllm.v2.runner import apply_cpu_stand_ins, engine
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.core.sched.scheduler import Scheduler

class Patch:  # the stand-ins outside pytest: applied for the child's lifetime
    setattr = staticmethod(setattr)

apply_cpu_stand_ins(Patch())
poisoned = torch.full((VOCAB,), float("nan"))
healable = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))
healable[[5, 17, 900]] = float("nan")
with engine(pathlib.Path(tempfile.mkdtemp())) as v2:
    for req_id in ("r0", "r1", "r2"):
        v2.add(req_id, [1, 5, 7, 9], temperature=0.0, logprobs=2)
    step = v2.step({"r1": poisoned, "r2": healable})
guards = installed()
got = step.by_id()
print(json.dumps({
    "finish": {r: str(o.finish_reason) for r, o in got.items()},
    "tokens": {r: o.new_token_ids for r, o in got.items()},
    "finite_logprobs": [all(v == v for v in lp) for lp in step.output.logprobs.logprobs],
    "counts": {f"{s}/{k}": v for (s, k), v in guards.counts().items()},
    "patches": sorted(f"{p.point.target}:{p.state}" for p in guards.patches()),
    "hooked": [hasattr(GPUModelRunner.sample, "__wrapped__"),
               hasattr(Scheduler.update_from_output, "__wrapped__")],
}))
""".replace("VOCAB", str(VOCAB))


@pytest.fixture(scope="module", params=["launcher", "plugin"])
def child_run(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    script = tmp_path_factory.mktemp("child") / "child.py"
    script.write_text(CHILD)
    command = [sys.executable, str(script)]
    if request.param == "launcher":
        command = [str(BIN / "guardrails"), "run", "--config", str(PROFILE), "--", *command]
    # clean_env keeps this process's TRITON_INTERPRET and CUDA_VISIBLE_DEVICES (conftest.py);
    # vLLM's allowlist is unset (every installed plugin loads) and the start-up event is JSON.
    env = clean_env()
    env.pop("VLLM_PLUGINS", None)
    env["GUARDRAILS_LOG_FORMAT"] = "json"
    run = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    run.way = request.param
    return run


def report(child_run) -> dict:  # type: ignore[no-untyped-def, type-arg]
    assert child_run.returncode == 0, child_run.stderr[-3000:]
    return json.loads(child_run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_guardrails_comes_in_once_by_the_way_it_was_installed(child_run) -> None:  # type: ignore[no-untyped-def]
    report(child_run)
    started = json_events(child_run.stderr, STARTED_EVENT)
    assert [event["installed_by"] for event in started] == [
        {"launcher": "launcher", "plugin": "plugin:vllm"}[child_run.way]
    ]
    assert started[0]["config_file"].endswith("vllm.toml")


def test_the_v2_points_and_hook_are_applied_in_the_child(child_run) -> None:  # type: ignore[no-untyped-def]
    got = report(child_run)
    v2 = "vllm.v1.worker.gpu."
    assert [p for p in got["patches"] if p.startswith(v2)] == [
        "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__:applied",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__:applied",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__:applied",
    ]
    assert got["hooked"] == [True, True]


def test_v2_is_guarded_and_the_poisoned_request_ended(outcome, child_run) -> None:  # type: ignore[no-untyped-def]
    got = report(child_run)
    counts = got["counts"]
    assert counts["sampler.logits/calls"] == 1
    assert counts["sampler.logits/nan"] == VOCAB + 3
    assert counts["sampler.logits/rows_no_valid_token"] == 1
    assert counts["sampler.token_ids/calls"] == 1
    assert got["finish"] == {"r0": "None", "r1": "error", "r2": "None"}
    assert got["tokens"]["r1"] == []
    assert got["tokens"]["r2"][0] not in (5, 17, 900)
    assert got["finite_logprobs"] == [True, True, True]
    outcome(
        component={
            "launcher": "guardrails run -- python child.py (V2 runner)",
            "plugin": "vLLM's plugin loader, no launcher (V2 runner)",
        }[child_run.way],
        dtype="float32",
        mode="greedy",
        fault="all-NaN row, NaN entries",
        unguarded="(issue 18, before V2's points) 0 guard calls, NaN logprobs, nothing ended",
        guarded="guard calls 1, counts exact, finite logprobs, r1 finish_reason=error",
    )
