"""Run by test_profile.py under `guardrails run --config config/profiles/sglang.toml`, or with
`plugins` as its second argument and no launcher: imports every module the profile targets,
then (`plugins`) calls SGLang's own `load_plugins()` as its scheduler process does once its
modules are imported, samples a batch with an all-NaN row through SGLang's own Sampler,
commits it the way the decode loop does, and prints what it saw as one JSON line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engines" / "stubs")]

import torch  # noqa: E402

import guardrails  # noqa: E402
from guardrails.integrations import sglang as hook  # noqa: E402
from tests.engines.sglang.engine import clean_logits, inject, load_engine, sample  # noqa: E402
from tests.engines.sglang.test_abort_hook import commit_decode_step, make_reqs  # noqa: E402

TARGET_MODULES = (
    "sglang.srt.layers.sampler",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.speculative.eagle_info",
    "sglang.srt.speculative.eagle_info_v2",
    "sglang.srt.managers.scheduler_components.batch_result_processor",
)

imported = {}
for name in TARGET_MODULES:
    try:
        importlib.import_module(name)
        imported[name] = "imported"
    except ModuleNotFoundError as exc:  # eagle_info_v2 is gone in 0.5.14+
        imported[name] = f"absent: {exc.name}"

if sys.argv[2:] == ["plugins"]:
    from sglang.srt.plugins import load_plugins

    load_plugins()

engine = load_engine()
logits = clean_logits(torch.float32)
inject(logits, sys.argv[1] if len(sys.argv) > 1 else "all_nan")
ids, output = sample(engine, logits, "random", return_logprob=True)
reqs = make_reqs(logits.shape[0])
commit_decode_step(hook._SchedulerHalf(), reqs, output, ids)
guards = guardrails.default()
print(
    json.dumps(
        {
            "imported": imported,
            "patches": {str(p.point.target): p.state for p in guards.patches()},
            "ids": ids.tolist(),
            "counts": {f"{s}/{k}": v for (s, k), v in guards.counts().items() if v},
            "finished": [req.finished_reason.to_json() if req.finished() else None for req in reqs],
            "logprobs_finite": bool(torch.isfinite(output.next_token_logprobs).all()),
        }
    )
)
