"""The real client: transformers `generate` on a tiny random GPT-2 in float16 on the CPU.

One block's MLP output overflows float16 in one batch row (a forward hook casts it through
float32 * 1e9), so that row's hidden state holds +-inf and its logits are NaN from then on.
The expected NaN counts come from a recording processor placed before the guard, never from
guardrails itself. The model and the recorder live in `tests/attach/tiny_gpt2.py`, which the
`guardrails run` client script below imports too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from guardrails import RowFlag  # noqa: E402
from guardrails.integrations.transformers import GuardLogitsProcessor  # noqa: E402
from guardrails.testing import fresh_guardrails  # noqa: E402
from tests.attach.tiny_gpt2 import (  # noqa: E402
    EOS,
    NEW_TOKENS,
    PAD,
    POISONED,
    VOCAB,
    Recorder,
    build_model,
    generate,
    poison,
    prompts,
)

ROOT = Path(__file__).resolve().parents[2]
LOGITS_LIST = "transformers.generation.logits_process:LogitsProcessorList"
STOPPING_LIST = "transformers.generation.stopping_criteria:StoppingCriteriaList"
PROFILE = ROOT / "config" / "profiles" / "transformers.toml"


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model()


@pytest.fixture
def poisoned(model: Any) -> Any:
    handle = poison(model)
    yield model
    handle.remove()


@pytest.fixture(scope="module")
def clean_greedy(model: Any) -> torch.Tensor:
    return generate(model, do_sample=False)


def test_unguarded_sampling_crashes_on_the_nan_row(poisoned: Any) -> None:
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"probability tensor contains either .inf., .nan. or"):
        generate(poisoned, do_sample=True)


def test_unguarded_greedy_emits_tokens_from_all_nan_scores_silently(poisoned: Any) -> None:
    out = poisoned.generate(
        prompts(),
        attention_mask=torch.ones(3, 5, dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        pad_token_id=PAD,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (3, 5 + NEW_TOKENS)  # no error, a token for every step
    assert all(bool(torch.isnan(step[POISONED]).all()) for step in out.scores)


def test_guarded_greedy_leaves_the_other_rows_identical_to_an_unpoisoned_run(
    poisoned: Any, clean_greedy: torch.Tensor
) -> None:
    guards = fresh_guardrails()
    out = generate(poisoned, GuardLogitsProcessor(guards), do_sample=False)
    others = [row for row in range(3) if row != POISONED]
    assert torch.equal(out[others], clean_greedy[others])
    assert not torch.equal(out[POISONED], clean_greedy[POISONED])


def test_guard_flags_the_poisoned_row_only(poisoned: Any) -> None:
    guard = GuardLogitsProcessor(fresh_guardrails())
    generate(poisoned, guard, do_sample=False)
    assert guard.last_flags is not None
    flags = [RowFlag(int(v)) for v in guard.last_flags.tolist()]
    assert flags[POISONED] == RowFlag.NAN | RowFlag.NO_VALID_TOKEN
    assert [f for row, f in enumerate(flags) if row != POISONED] == [RowFlag(0), RowFlag(0)]


def test_guard_counts_exactly_the_nan_values_the_model_produced(poisoned: Any) -> None:
    guards = fresh_guardrails()
    recorder = Recorder()
    generate(poisoned, recorder, GuardLogitsProcessor(guards), do_sample=False)
    assert recorder.nan == NEW_TOKENS * VOCAB  # every step, the whole poisoned row
    assert guards.count("sampler.logits", "nan") == recorder.nan
    assert guards.count("sampler.logits", "rows_no_valid_token") == recorder.steps


def test_guarded_sampling_completes_for_every_row(poisoned: Any) -> None:
    guards = fresh_guardrails()
    torch.manual_seed(0)
    out = generate(poisoned, GuardLogitsProcessor(guards), do_sample=True)
    assert out.shape == (3, 5 + NEW_TOKENS)
    assert bool(((out >= 0) & (out < VOCAB)).all())
    assert guards.count("sampler.logits", "rows_no_valid_token") == NEW_TOKENS


def test_abort_policy_from_settings_ends_the_poisoned_row_with_eos(
    poisoned: Any, clean_greedy: torch.Tensor
) -> None:
    guards = fresh_guardrails(sites={"sampler.logits": {"abort_on": ["no_valid_token"]}})
    guard = GuardLogitsProcessor(guards, eos_token_id=poisoned.generation_config.eos_token_id)
    out = generate(poisoned, guard, do_sample=True)
    new = out[POISONED, 5:].tolist()
    assert new == [EOS] + [PAD] * (NEW_TOKENS - 1)
    others = [row for row in range(3) if row != POISONED]
    assert out[others].shape == clean_greedy[others].shape
    assert guard.aborted_rows() == NEW_TOKENS  # forced again each step the row stays bad


def test_abort_policy_without_eos_token_id_is_refused() -> None:
    guards = fresh_guardrails(sites={"sampler.logits": {"abort_on": ["no_valid_token"]}})
    with pytest.raises(ValueError, match="needs eos_token_id"):
        GuardLogitsProcessor(guards)


def test_abort_policy_ends_a_row_at_each_of_several_eos_ids() -> None:
    guards = fresh_guardrails()
    guard = GuardLogitsProcessor(guards, eos_token_id=[2, 7], abort_on=["nan"])
    scores = torch.randn(3, 10)
    scores[1, 4] = float("nan")
    out = guard(torch.zeros(3, 1, dtype=torch.long), scores)
    expected = torch.full((10,), float("-inf"))
    expected[[2, 7]] = 0.0
    assert torch.equal(out[1], expected)
    assert torch.equal(out[[0, 2]], scores[[0, 2]])
    assert guard.aborted_rows() == 1


@pytest.mark.cuda
def test_abort_policy_first_met_inside_a_capture_is_refused_and_replays_after_one_call() -> None:
    guards = fresh_guardrails(reporting={"every_calls": 1_000_000})
    guards.site("sampler.logits").reserve(4, "cuda")
    guard = GuardLogitsProcessor(guards, eos_token_id=3, abort_on=["no_valid_token"])
    ids = torch.zeros(4, 1, dtype=torch.long, device="cuda")
    static = torch.randn(4, 512, device="cuda")
    torch.cuda.synchronize()
    refused = pytest.raises(RuntimeError, match=r"once .* before capturing")
    with refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
        guard(ids, static)
    guard(ids, static.clone())  # makes the EOS row and this thread's counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = guard(ids, static)
    for _ in range(3):
        static.copy_(torch.randn(4, 512, device="cuda"))
        static[2] = float("nan")
        graph.replay()
    torch.cuda.synchronize()
    assert int(out[2].argmax()) == 3
    assert out[2].isfinite().sum() == 1
    assert torch.equal(out[[0, 1, 3]], static[[0, 1, 3]])
    assert guard.aborted_rows() == 3


def test_heal_policy_is_the_default() -> None:
    guard = GuardLogitsProcessor(fresh_guardrails())
    assert guard.abort_flags == 0


def test_eos_at_stopping_criteria_ends_the_poisoned_row_and_keeps_its_prompt(
    poisoned: Any, clean_greedy: torch.Tensor
) -> None:
    # The token site at StoppingCriteriaList.__call__ sees the whole input_ids [batch, prompt +
    # generated]: only the id sampled in this step may become EOS (it once rewrote the row).
    guards = fresh_guardrails(
        attach=[
            {"site": "sampler.logits", "target": f"{LOGITS_LIST}.__call__", "tensor": "return"},
            {
                "site": "sampler.token_ids",
                "kind": "token_ids",
                "target": f"{STOPPING_LIST}.__call__",
                "tensor": "arg:input_ids",
                "vocab_size": VOCAB,
            },
        ],
        sites={"sampler.token_ids": {"on_no_valid_token": "eos", "eos_token_id": EOS}},
    )
    handles = guards.attach_configured(on_error=_raise)
    try:
        out = generate(poisoned, do_sample=True)
    finally:
        for handle in handles:  # later tests attach to the same methods
            handle.remove()
        guards.close()
    assert torch.equal(out[:, :5], prompts())  # every prompt intact, the poisoned one too
    # Ended at its first step; its logits stay NaN, so the pad of each later step is the
    # step's sampled id and becomes EOS again.
    assert out[POISONED, 5:].tolist() == [EOS] * NEW_TOKENS
    others = [row for row in range(3) if row != POISONED]
    assert out[others].shape == clean_greedy[others].shape


def _raise(exc: Exception) -> None:
    raise exc


# -- the same client under `guardrails run` + config/profiles/transformers.toml -------------

SCRIPT = """
import json, sys, torch
from tests.attach.tiny_gpt2 import (
    NEW_TOKENS, POISONED, Recorder, build_model, generate, poison,
)

model = build_model()
clean = generate(model, do_sample=False)
handle = poison(model)
recorder = Recorder()
greedy = generate(model, recorder, do_sample=False)
torch.manual_seed(0)
sampled = generate(model, do_sample=True)  # unguarded, this raises (see above)
handle.remove()

import guardrails  # only to read the counters the launcher's instance kept
from guardrails.integrations.launcher import installed

guards = installed()
print("RESULT", json.dumps({
    "installed": guards is not None,
    "clean": clean.tolist(),
    "greedy": greedy.tolist(),
    "sampled_shape": list(sampled.shape),
    "recorded_nan": recorder.nan,
    "recorded_steps": recorder.steps,
    "counts": {f"{s}/{k}": v for (s, k), v in guards.counts().items()} if guards else {},
    "beats": guards.liveness.beats if guards and guards.liveness else 0,
    "not_called": __import__("prometheus_client").REGISTRY.get_sample_value(
        "guardrails_site_not_called", {"site": "sampler.logits", "rank": "0"}),
}))
"""


def test_guardrails_run_with_the_transformers_profile_guards_generate(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GUARDRAILS_LIVENESS_STEPS": "4"}
    command = [sys.executable, "-m", "guardrails", "run", "--config", str(PROFILE), "--"]
    proc = subprocess.run(
        [*command, sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["installed"]
    others = [row for row in range(3) if row != POISONED]
    assert [result["greedy"][r] for r in others] == [result["clean"][r] for r in others]
    assert result["sampled_shape"] == [3, 5 + NEW_TOKENS]
    counts = result["counts"]
    assert result["recorded_nan"] == NEW_TOKENS * VOCAB
    # The recorder saw the poisoned greedy run; the sampling run adds as many NaN again.
    assert counts["sampler.logits/nan"] == 2 * result["recorded_nan"]
    assert counts["sampler.logits/rows_no_valid_token"] == 2 * result["recorded_steps"]
    # The heartbeat (StopCheck) beat at every step of the three generate() calls, and the
    # liveness self-check found the profile's site on generate()'s path.
    assert result["beats"] == 3 * NEW_TOKENS
    assert result["not_called"] == 0.0


def test_guardrails_imports_and_guards_without_transformers() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # any import of it now fails\n"
        "import torch, guardrails\n"
        "from guardrails.testing import fresh_guardrails\n"
        "print(fresh_guardrails().site('sampler.logits')(torch.tensor([[float('nan'), 0.0]])))\n"
        "try:\n"
        "    import guardrails.integrations.transformers\n"
        "except ImportError:\n"
        "    print('integration needs transformers')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "tensor([1], dtype=torch.uint8)" in proc.stdout
    assert "integration needs transformers" in proc.stdout
