"""SGLang's server with `--tp 2` on its CPU engine, started the launcher's way (`guardrails
run`; SGLang's plugin entry is called in each process too and finds guardrails there): two scheduler
processes (TP0, TP1), each with its model shard and its own Sampler over the whole (gathered)
logits, pinned to one core each (`SGLANG_CPU_OMP_THREADS_BIND="0|1"`: with more ranks than
NUMA nodes SGLang wants the binding spelled out). Starts in 35-70 s on 2 cores. Its greedy
text is its own: the sharded matmuls' bfloat16 partial sums part from TP 1's after a few words.

Both ranks guard their sampler and both end the poisoned request (each rank's scheduler
processes the same batch). Each rank's series carry its own rank (torch.distributed's, which
SGLang starts after the sampler's module is imported and the site made), and each counts the
poisoned rows it saw: sums over `rank` count each tensor-parallel copy. Every poisoned request
here is sent alone, so each rank sees it twice (its prefill and the decode step in flight,
test_serve.py says why).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    POISONED,
    SAMPLED,
    chat,
    samples,
    stream,
    wait_for_sample,
)
from tests.e2e.server import Server
from tests.e2e.sglang.serve import WATCHED, assert_aborted, serving, wait_for_log

TP = 2
ROWS = "guardrails_flagged_rows_total"
ABORTED_EVENT = "guardrails.request_aborted"
pytestmark = pytest.mark.skipif(
    (os.cpu_count() or 1) < TP, reason=f"--tp {TP} binds one core per rank"
)


@pytest.fixture(scope="module")
def tensor_parallel(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("tp2") / "server.log"
    binding = "|".join(str(core) for core in range(TP))
    with serving(
        model_dir,
        log,
        "--tp",
        str(TP),
        way="launcher",
        env={"SGLANG_CPU_OMP_THREADS_BIND": binding},
    ) as server:
        yield server


def by_rank(server: Server, name: str, **labels: str) -> dict[str, float]:
    """A series' values by its `rank` label."""
    return {
        dict(key)["rank"]: value
        for (found, key), value in samples(server).items()
        if found == name and labels.items() <= dict(key).items()
    }


def lines_by_scheduler(server: Server, event: str) -> dict[str, int]:
    """How many lines of `event` each TP scheduler logged (SGLang prefixes them "TP<n>")."""
    text = server.log.read_text(errors="replace")
    found = re.findall(rf"\[[^\]]* (TP\d+)\] {re.escape(event)} ", text)
    return {tp: found.count(tp) for tp in sorted(set(found))}


def test_under_tp_2_a_poisoned_request_still_ends_with_an_error(tensor_parallel: Server) -> None:
    server = tensor_parallel
    clean = chat(server, CLEAN[0], GREEDY)
    assert (clean.error, clean.finish_reason) == (None, "length")
    assert len(clean.text.split()) == 12
    assert_aborted(chat(server, POISONED[0], GREEDY))
    assert_aborted(stream(server, POISONED[1], SAMPLED), streamed=True)
    after = chat(server, CLEAN[1], GREEDY)
    assert (after.error, after.finish_reason) == (None, "length")
    assert server.alive()
    assert server.health()[0] == 200


def test_under_tp_2_each_rank_ends_the_request_and_counts_under_its_own_rank(
    tensor_parallel: Server,
) -> None:
    server = tensor_parallel
    logged = lines_by_scheduler(server, ABORTED_EVENT)
    assert_aborted(chat(server, POISONED[0], GREEDY))
    sent = server.poisoned_sent  # all of them alone, in this module
    # Each scheduler flagged the poisoned row and ended the request itself.
    expected = {f"TP{rank}": logged.get(f"TP{rank}", 0) + 1 for rank in range(TP)}

    def logged_by_all() -> int:
        found = lines_by_scheduler(server, ABORTED_EVENT)
        return int(all(found.get(tp, 0) >= n for tp, n in expected.items()))

    wait_for_log(logged_by_all, 1)
    assert lines_by_scheduler(server, ABORTED_EVENT) == expected
    assert set(lines_by_scheduler(server, "guardrails.no_valid_token")) == set(expected)
    site = {"site": "sampler.logits"}
    ranks = {str(rank) for rank in range(TP)}
    for rank in ranks:
        wait_for_sample(server, ROWS, 2 * sent, reason="no_valid_token", rank=rank, **site)
    rows = by_rank(server, ROWS, reason="no_valid_token", **site)
    nan = by_rank(server, "guardrails_nonfinite_values_total", kind="nan", **site)
    calls = by_rank(server, "guardrails_guard_calls_total", **site)
    print(f"\n[e2e] --tp {TP}: by rank: flagged rows {rows}, NaN {nan}, guard calls {calls}")
    assert rows == dict.fromkeys(ranks, 2.0 * sent), (rows, sent)
    assert nan == dict.fromkeys(ranks, 2.0 * sent * tiny_llama.VOCAB), nan
    assert set(calls) == ranks
    assert all(value > 2 * sent for value in calls.values()), calls
    silent = {
        (dict(key)["site"], dict(key)["rank"]): value
        for (name, key), value in samples(server).items()
        if name == "guardrails_site_not_called"
    }
    assert {site for site, _ in silent} == WATCHED, silent
    assert {rank for _, rank in silent} == ranks, silent
    assert set(silent.values()) == {0.0}, silent
    assert "guardrails.site_not_called" not in server.log.read_text(errors="replace")
