"""The SGLang profile against the installed SGLang: `guardrails check --strict`, which targets
apply to this version, and one case in a child process, installed through `guardrails run` and
through SGLang's own plugin loader (no launcher, no configuration)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from guardrails.names import STARTED_EVENT
from tests.engines.sglang.conftest import STUBS
from tests.engines.sglang.engine import FAULT_ROW, NEW, PROFILE, ROOT, V, guarded
from tests.processes import json_events

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
    env.pop("SGLANG_PLUGINS", None)  # SGLang's allowlist unset: every installed plugin loads
    # The torchvision stub (SGLang imports torchvision at module level; see its docstring).
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(ROOT)])
    env.update(extra)
    return env


def run(
    *args: str, timeout: float = 240, command: str = "guardrails", **env: str
) -> subprocess.CompletedProcess[str]:
    """`command ARGS` of this venv in a child (`child_env`, JSON logs, `env` over them)."""
    return subprocess.run(
        [str(BIN / command), *args],
        cwd=ROOT,
        env=child_env(GUARDRAILS_LOG_FORMAT="json", **env),
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


@pytest.mark.parametrize("way", ["launcher", "plugin"])
def test_the_child_is_guarded_and_the_poisoned_request_aborted(outcome: Any, way: str) -> None:
    if way == "launcher":
        args = ["run", "--config", str(PROFILE), "--", sys.executable, str(CHILD), "all_nan"]
        done = run(*args)
    else:
        done = run(str(CHILD), "all_nan", "plugins", command="python")
    assert done.returncode == 0, done.stderr[-3000:]
    started = json_events(done.stderr, STARTED_EVENT)
    installed_by = {"launcher": "launcher", "plugin": "plugin:sglang"}[way]
    assert [event["installed_by"] for event in started] == [installed_by]
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
        component={"launcher": "guardrails run child", "plugin": "plugin-loaded child"}[way],
        dtype="float32",
        mode="random",
        fault="all_nan",
        unguarded="not run in the child (see the scheduler abort hook row)",
        guarded=f"ids {seen['ids']}: FINISH_ABORT 503, {V} NaN counted",
    )


# The scheduler process loads its plugins (`load_plugins()` in run_scheduler_process) once
# its module is imported: a module that copied `eagle_sample` by `from ... import` before
# then would keep calling the unguarded original (eagle.verify has no liveness beat to say
# so). SGLang's HookRegistry rebinds such copies; guardrails' own patch does not, and need not
# while no copy exists by then, which this child checks on the installed SGLang.
COPIES = """
import sys
import sglang.srt.managers.scheduler
from sglang.srt.plugins import load_plugins
load_plugins()

def main():  # locals only: the scan below must not find this script's own names
    import sglang.srt.speculative.eagle_utils as utils
    wrapped = utils.eagle_sample
    original = getattr(wrapped, "__wrapped__", None)
    stale = sorted(
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        for attr, value in list(getattr(module, "__dict__", {}).items())
        if original is not None and value is original
    )
    print(hasattr(wrapped, "__guardrails_patch__"), stale)

main()
"""


@pytest.mark.skipif(not NEW, reason="eagle_sample, a module function, exists from 0.5.14 on")
def test_no_copy_of_eagle_sample_escapes_the_plugin_in_the_scheduler_process() -> None:
    stubs = ROOT / "tests" / "e2e" / "sglang" / "stubs"  # sgl_kernel: the scheduler imports it
    path = os.pathsep.join([str(STUBS), str(ROOT), str(stubs)])
    done = run(
        "-c", COPIES, timeout=300, command="python", SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True []"
