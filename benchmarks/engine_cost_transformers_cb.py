"""The cost of config/profiles/transformers-serve.toml inside transformers' continuous batching,
as a share of the unguarded batching step, in one process.

    .venv/bin/python -m benchmarks.engine_cost_transformers_cb [--reps N]

transformers 5.24.0's own `generate_batch` (sync batching, CPU, sdpa), greedy, 8 prompts of
32 tokens, 32 new tokens each. A step is `ModelRunner.compute_batch` (forward, the guard at
`ModelRunner._sample`, the hook's key/value heal at every layer's `PagedAttentionCache.update`)
plus `ContinuousBatchProcessor.update_batch` (the hook's batch-update halves), timed in the
batching worker. Guarded means the profile's [[attach]] entries and hook applied as `guardrails
run` applies them; guarded and unguarded runs alternate rep by rep (applied and removed
between reps), so drift in the machine's speed hits both alike. Two models: the e2e suite's
tiny float16 Llama (tests/tiny_llama.py: 64 wide, 2 layers, vocab 187) and a small float32
one (512 wide, 4 layers, vocab 32000). The figure is median guarded step / median unguarded
step. Writes benchmarks/results/engine_cost_transformers_cb.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import guardrails as gr
from tests import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "config" / "profiles" / "transformers-serve.toml"
OUT = Path(__file__).resolve().parent / "results" / "engine_cost_transformers_cb.json"
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 32, 32


def _small_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


class _StepTimer:
    """Seconds spent in compute_batch + update_batch, per batching step (worker thread)."""

    def __init__(self) -> None:
        from transformers.generation.continuous_batching import continuous_api, model_runner

        self.steps: list[float] = []
        self._lock = threading.Lock()
        self._originals = (
            (model_runner.ModelRunner, "compute_batch"),
            (continuous_api.ContinuousBatchProcessor, "update_batch"),
        )
        self._saved = [getattr(owner, name) for owner, name in self._originals]
        self._pending = 0.0
        timer = self

        def timed(original: Any, closes_step: bool) -> Any:
            def call(self_: Any, *args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(self_, *args, **kwargs)
                finally:
                    timer._add(time.perf_counter() - start, closes_step)

            return call

        for (owner, name), original in zip(self._originals, self._saved, strict=True):
            setattr(owner, name, timed(original, name == "update_batch"))

    def _add(self, seconds: float, closes_step: bool) -> None:
        with self._lock:
            self._pending += seconds
            if closes_step:
                self.steps.append(self._pending)
                self._pending = 0.0

    def take(self) -> list[float]:
        with self._lock:
            steps, self.steps = self.steps, []
            return steps


def _run(model: Any, inputs: list[list[int]]) -> None:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=256, max_batch_tokens=512)
    model.generate_batch(
        inputs, generation_config=config, continuous_batching_config=cb, progress_bar=False
    )


def measure(name: str, model: Any, vocab: int, reps: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    # Clean prompts: words only (the tiny model's trigger is its last id).
    inputs = [
        torch.randint(4, vocab - 1, (PROMPT_LEN,), generator=generator).tolist()
        for _ in range(PROMPTS)
    ]
    guards = gr.Guardrails(
        gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}),
        registry=CollectorRegistry(),
    )
    timer = _StepTimer()
    _run(model, inputs)  # warm-up, unguarded
    timer.take()
    times: dict[str, list[float]] = {"unguarded": [], "guarded": []}
    for _ in range(reps):
        for mode in ("unguarded", "guarded"):
            handles: list[Any] = []
            if mode == "guarded":
                handles = [*guards.attach_configured(), *guards.install_hooks()]
                # All but the serving layer's half (transformers.cli.serving is not imported).
                states = [h.state for h in handles if "cli.serving" not in repr(h)]
                assert set(states) == {"applied"}, handles
            _run(model, inputs)
            for handle in handles:
                handle.remove()
            times[mode].extend(timer.take())
    calls = guards.count("sampler.logits", "nan")
    guards.close()
    unguarded = statistics.median(times["unguarded"])
    guarded = statistics.median(times["guarded"])
    return {
        "model": name,
        "steps_per_run": len(times["guarded"]) // reps,
        "unguarded_step_ms": round(unguarded * 1e3, 3),
        "guarded_step_ms": round(guarded * 1e3, 3),
        "ratio": round(guarded / unguarded, 3),
        "nan_counted": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [
        measure("tiny float16 (e2e)", tiny_llama.build_model(), tiny_llama.VOCAB, args.reps),
        measure("small float32", _small_model(), 32000, args.reps),
    ]
    for row in results:
        print(
            f"{row['model']:<20} step unguarded {row['unguarded_step_ms']:8.3f} ms  "
            f"guarded {row['guarded_step_ms']:8.3f} ms  ratio {row['ratio']:.3f}x  "
            f"({row['steps_per_run']} steps per run)"
        )
    OUT.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "threads": 1,
                "reps": args.reps,
                "results": results,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    main()
