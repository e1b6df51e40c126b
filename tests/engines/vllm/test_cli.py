"""The vLLM profile through guardrails' own commands, in this venv: `guardrails check
--strict` and `guardrails run -- python child.py` with vLLM's real sampler in the child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .faults import PROFILE

BIN = Path(sys.executable).parent
ROOT = PROFILE.parents[2]

CHILD = r"""
import json, sys, torch
# Every module the profile and its hook target: importing them must never end the process.
import vllm.v1.sample.sampler, vllm.v1.sample.rejection_sampler
import vllm.v1.core.sched.scheduler, vllm.v1.worker.gpu_model_runner
from guardrails.integrations.launcher import installed
from tests.engines.vllm.faults import faulty_logits, metadata, ids_of
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.core.sched.scheduler import Scheduler

out = Sampler()(faulty_logits(torch.float32), metadata("greedy", logprobs=2))
guards = installed()
print(json.dumps({
    "ids": ids_of(out),
    "finite": bool(out.logprobs_tensors.logprobs.isfinite().all()),
    "counts": {f"{s}/{k}": v for (s, k), v in guards.counts().items()},
    "patches": sorted(f"{p.point.site}:{p.state}" for p in guards.patches()),
    "hooked": [hasattr(GPUModelRunner._bookkeeping_sync, "__wrapped__"),
               hasattr(Scheduler.update_from_output, "__wrapped__")],
}))
"""


def clean_env() -> dict[str, str]:
    """This process's environment without GUARDRAILS_* and without the suite's own
    `VLLM_PLUGINS=""` (conftest.py): the child and `guardrails check` see vLLM as installed,
    its plugins allowed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.fixture(scope="module")
def child_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    script = tmp_path_factory.mktemp("child") / "child.py"
    script.write_text(CHILD)
    return subprocess.run(
        [
            str(BIN / "guardrails"),
            "run",
            "--config",
            str(PROFILE),
            "--",
            sys.executable,
            str(script),
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_guardrails_check_strict_passes_on_the_vllm_profile() -> None:
    done = subprocess.run(
        [str(BIN / "guardrails"), "check", "--strict", "--config", str(PROFILE)],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vllm.end_poisoned_requests" in done.stdout


def test_importing_every_targeted_module_under_guardrails_run_keeps_the_process(child_run) -> None:  # type: ignore[no-untyped-def]
    assert child_run.returncode == 0, child_run.stderr[-3000:]
    report = json.loads(child_run.stdout.strip().splitlines()[-1])
    # The V1 model runner's points apply; Model Runner V2's wait for modules this child
    # never imports (tests/engines/vllm/v2/test_cli.py runs the V2 side); the standalone CPU
    # runner's are for vLLM 0.34 on (this suite runs where V1 exists: before 0.34).
    assert report["patches"] == [
        "eagle.verify:applied",
        "sampler.logits:applied",
        "sampler.logits:inapplicable",
        "sampler.logits:pending",
        "sampler.logits:pending",
        "sampler.token_ids:applied",
        "sampler.token_ids:inapplicable",
        "sampler.token_ids:pending",
    ]
    assert report["hooked"] == [True, True]


def test_guardrails_run_guards_vllms_sampler_in_the_child(outcome, child_run) -> None:  # type: ignore[no-untyped-def]
    assert child_run.returncode == 0, child_run.stderr[-3000:]
    report = json.loads(child_run.stdout.strip().splitlines()[-1])
    ids = report["ids"]
    assert ids[2] == 311  # the +Inf entry stays the top token
    assert ids[1] not in (5, 17, 900)  # a NaN entry is never picked
    assert report["finite"] is True
    counts = report["counts"]
    assert counts["sampler.logits/nan"] == 3 + 4096
    assert counts["sampler.logits/posinf"] == 1
    assert counts["sampler.logits/rows_no_valid_token"] == 2
    assert counts["sampler.token_ids/oob_token"] == 0
    outcome(
        component="guardrails run -- python child.py",
        dtype="float32",
        mode="greedy",
        fault="NaN entries, +Inf, all-NaN, all -inf",
        unguarded="(in-process run of the same batch) ids [393, 5, 311, 0, 0, 2415], NaN logprobs",
        guarded=f"ids {ids}, finite logprobs, counts exact",
    )
