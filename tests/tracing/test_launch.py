"""Under `guardrails run` with `GUARDRAILS_TRACE`, the model transformers builds is traced
with no code change: a real launcher and process, the shipped transformers profile, the tiny
float16 Llama saved to disk and loaded back with `from_pretrained`, decoded by `generate()`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.processes import ROOT, child_env, run_python
from tests.tiny_llama import save

PROFILE = ROOT / "config" / "profiles" / "transformers.toml"
SCRIPT = """
import sys, torch, transformers, guardrails
from tests.tiny_llama import SPECIALS, TRIGGER, WORDS
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16)
trigger = len(SPECIALS) + WORDS.index(TRIGGER)
words = [5, 6, 7] if sys.argv[2] == "clean" else [5, trigger, 7]
with torch.no_grad():
    model.generate(torch.tensor([words]), max_new_tokens=3, do_sample=False)
guards = guardrails.default()
guards.poll()
guards.flush()
print("hooks", sum(len(m._forward_hooks) for m in model.modules()))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("tiny-llama"))


def run(model_dir: Path, words: str, **env: str) -> tuple[str, str]:
    proc = run_python(
        "-m",
        "guardrails",
        "run",
        "--config",
        str(PROFILE),
        "--",
        sys.executable,
        "-c",
        SCRIPT,
        str(model_dir),
        words,
        env=child_env(PYTHONPATH=str(ROOT), **env),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def test_the_built_model_is_traced_and_the_origin_named(model_dir: Path) -> None:
    out, err = run(model_dir, "poisoned", GUARDRAILS_TRACE="model.layers.*")
    assert "guardrails.nonfinite_origin module=model.layers.0.mlp " in err
    assert "site=sampler.logits" in err
    hooks = int(out.split("hooks")[-1])
    assert hooks == 2 * 13  # 13 modules in each of the two layers (the model: its forward wrapped)


def test_a_clean_run_names_nothing(model_dir: Path) -> None:
    out, err = run(model_dir, "clean", GUARDRAILS_TRACE="model.layers.*")
    assert "guardrails.nonfinite_origin" not in err
    assert int(out.split("hooks")[-1]) > 0


def test_without_trace_settings_nothing_is_hooked(model_dir: Path) -> None:
    out, err = run(model_dir, "poisoned")
    assert "guardrails.nonfinite_origin" not in err
    assert int(out.split("hooks")[-1]) == 0


def test_patterns_that_fit_no_module_are_an_attach_error_not_a_crash(model_dir: Path) -> None:
    out, err = run(model_dir, "poisoned", GUARDRAILS_TRACE="transformer.h.*")
    assert "guardrails.attach_error" in err
    assert "matches no module" in err
    assert int(out.split("hooks")[-1]) == 0
