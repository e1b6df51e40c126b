"""The SGLang profile against the installed SGLang: `guardrails check --strict`, which targets
apply to this version, and one case through `guardrails run` in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.engines.sglang.conftest import STUBS
from tests.engines.sglang.engine import FAULT_ROW, NEW, PROFILE, ROOT, V, guarded

BIN = Path(sys.executable).parent
CHILD = Path(__file__).with_name("child.py")
# Applied when the module is imported (pending until then) on this version; the others are
# for the other side of `when = "sglang>=0.5.14"`.
NEW_TARGETS = {
    "sglang.srt.layers.sampler:sanitize_nan_logits",
    "sglang.srt.speculative.eagle_utils:eagle_sample",
    "sglang.srt.layers.sampler:Sampler.forward",
}
OLD_TARGETS = {
    "sglang.srt.layers.sampler:Sampler._preprocess_logits",
    "sglang.srt.speculative.eagle_info_v2:EagleVerifyInputV2Mixin.sample",
    "sglang.srt.speculative.eagle_info:EagleVerifyInput.verify",
    "sglang.srt.layers.sampler:Sampler.forward",
}


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    # The torchvision stub (SGLang imports torchvision at module level; see its docstring).
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(ROOT)])
    env.update(extra)
    return env


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "guardrails"), *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_guardrails_check_strict_passes_with_the_sglang_profile() -> None:
    done = run("check", "--strict", "--config", str(PROFILE))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_profile_applies_the_targets_of_this_sglang_version(engine: Any) -> None:
    applies = NEW_TARGETS if NEW else OLD_TARGETS
    with guarded(hooks=False) as guards:
        states = {str(h.point.target): h.state for h in guards.patches()}
    assert {t for t, s in states.items() if s != "inapplicable"} == applies
    assert all(states[t] in {"applied", "pending"} for t in applies)


def test_guardrails_run_guards_and_aborts_in_the_child(outcome: Any) -> None:
    done = run("run", "--config", str(PROFILE), "--", sys.executable, str(CHILD), "all_nan")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    applies = NEW_TARGETS if NEW else OLD_TARGETS
    assert {t for t, s in seen["patches"].items() if s == "applied"} <= applies
    assert "sglang.srt.layers.sampler:Sampler.forward" in seen["patches"]
    assert all(s in {"applied", "inapplicable"} for s in seen["patches"].values()), seen
    assert seen["counts"]["sampler.logits/nan"] == V
    assert seen["counts"]["sampler.logits/rows_no_valid_token"] == 1
    assert seen["logprobs_finite"] is True
    finished = seen["finished"]
    assert finished[FAULT_ROW]["type"] == "abort"
    assert finished[FAULT_ROW]["status_code"] == 503
    assert [f is None for i, f in enumerate(finished) if i != FAULT_ROW] == [True] * 4
    outcome(
        component="guardrails run child",
        dtype="float32",
        mode="random",
        fault="all_nan",
        unguarded="not run in the child (see the scheduler abort hook row)",
        guarded=f"ids {seen['ids']}: FINISH_ABORT 503, {V} NaN counted",
    )
