"""The `rank` label of a worker whose process group starts after its sites are made (vLLM's and
SGLang's tensor-parallel workers import their samplers first, and set no RANK variable): real
processes, a real gloo process group of two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import ROOT, child_env

WORKER = """
import sys
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, generate_latest
import guardrails as gr

rank, store = int(sys.argv[1]), sys.argv[2]
registry = CollectorRegistry()
guards = gr.Guardrails(gr.GuardSettings(environ={}), registry=registry)
site = guards.site("sampler.logits")  # made before the process group, as engines do
logits = torch.zeros(2, 8)
logits[0] = float("nan")
site(logits)
guards.poll()
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
logits = torch.zeros(2, 8)
logits[1] = float("nan")
site(logits)
guards.poll()
dist.barrier()
print(generate_latest(registry).decode())
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_series_move_to_the_process_groups_rank_once_it_starts(tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = child_env()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), str(store)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [worker.communicate(timeout=120) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], [err for _, err in outs]
    second = outs[1][0]
    rows = 'guardrails_flagged_rows_total{rank="%s",reason="no_valid_token",site="sampler.logits"}'
    calls = 'guardrails_guard_calls_total{rank="%s",site="sampler.logits"}'
    # Before the process group: 0, the only rank anything said; after it: its real rank.
    assert f"{rows % 0} 1.0" in second
    assert f"{rows % 1} 1.0" in second
    assert f"{calls % 0} 1.0" in second
    assert f"{calls % 1} 1.0" in second
    # Rank 0 stays 0 throughout: one series, both calls.
    assert f"{calls % 0} 2.0" in outs[0][0]
    assert 'rank="1"' not in outs[0][0]
