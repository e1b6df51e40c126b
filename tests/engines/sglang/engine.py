"""SGLang's real classes, configured for one CPU process, and the batches the suite feeds them.

`load_engine()` imports SGLang and publishes its process configuration the way each version
does at start-up (0.5.14+: `runtime_context.publish`; 0.5.13: the global server args), with
the `pytorch` sampling backend (the one SGLang uses where FlashInfer is absent). The
tensor-parallel group is a single-rank stand-in: on one rank SGLang only touches it to
all-reduce token ids, which it skips unless SYNC_TOKEN_IDS_ACROSS_TP is set or a grammar is
used, and neither is here. `batch_info()` builds SamplingBatchInfo with the fields and dtypes
`SamplingBatchInfo.from_schedule_batch` gives them (its own constructor; a ScheduleBatch of
real requests needs a model, a KV pool and a tokenizer).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from packaging.version import Version

from guardrails import Guardrails, GuardSettings

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "config" / "profiles" / "sglang.toml"
VERSION = Version(importlib.metadata.version("sglang"))
NEW = Version("0.5.14") <= VERSION  # where the profile's `when` ranges split

B, V = 5, 4096  # rows, vocabulary (V matters for how much a NaN row spreads)
FAULT_ROW = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("greedy", "random", "top_k_top_p")
TOP_K_ALL = 1 << 30  # sglang.srt.sampling.sampling_params.TOP_K_ALL
TEMPERATURE = 0.7  # of the sampled modes; greedy requests are temperature 1, top_k 1


@dataclass
class Engine:
    version: Version
    sampler: Any  # an sglang Sampler
    SamplingBatchInfo: Any
    LogitsProcessorOutput: Any


def load_engine() -> Engine:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", sampling_backend="pytorch")
    single_rank = SimpleNamespace(device_group=None, world_size=1)
    if NEW:
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

        reset_context()
        publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
        get_parallel().override_permanently(tp_group=single_rank)
    else:
        from sglang.srt.distributed import parallel_state
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(args)
        parallel_state._TP = single_rank
    return Engine(VERSION, Sampler(), SamplingBatchInfo, LogitsProcessorOutput)


def batch_info(engine: Engine, mode: str, rows: int = B, vocab: int = V) -> Any:
    """SamplingBatchInfo for `rows` requests of one sampling mode."""
    greedy = mode == "greedy"
    top_k = 1 if greedy else (50 if mode == "top_k_top_p" else TOP_K_ALL)
    top_p = 0.9 if mode == "top_k_top_p" else 1.0
    temperature = 1.0 if greedy else TEMPERATURE
    fields = {
        "temperatures": torch.full((rows, 1), temperature, dtype=torch.float),
        "top_ps": torch.full((rows,), top_p, dtype=torch.float),
        "top_ks": torch.full((rows,), top_k, dtype=torch.int32),
        "min_ps": torch.zeros((rows,), dtype=torch.float),
        "is_all_greedy": greedy,
        "is_any_greedy": greedy,
        "need_top_p_sampling": top_p != 1.0,
        "need_top_k_sampling": top_k != TOP_K_ALL,
        "need_min_p_sampling": False,
        "vocab_size": vocab,
        "device": "cpu",
    }
    # 0.5.13 has no is_any_greedy; pass what this version's constructor takes.
    accepted = {f.name for f in dataclasses.fields(engine.SamplingBatchInfo)}
    return engine.SamplingBatchInfo(**{k: v for k, v in fields.items() if k in accepted})


def clean_logits(dtype: torch.dtype, rows: int = B, vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Random logits whose rows have a clear top token (so greedy answers are unambiguous)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    return logits.to(dtype)


# Faults written into row FAULT_ROW; `masked` is the same row with the bad entries set to -inf
# (what a guarded sampler must behave like), None where no finite entry is left.
NAN_COLS = (7, 100, 2000, 4000)
POSINF_COL = 311
MASK_COLS = slice(0, V // 2)
FAULTS = ("nan_entries", "posinf", "all_nan", "all_neginf", "neginf_mask")


def inject(logits: torch.Tensor, fault: str) -> torch.Tensor | None:
    """Write `fault` into FAULT_ROW in place; returns the masked-equivalent logits or None."""
    masked = logits.clone()
    row = logits[FAULT_ROW]
    if fault == "nan_entries":
        row[list(NAN_COLS)] = math.nan
        masked[FAULT_ROW, list(NAN_COLS)] = -math.inf
        return masked
    if fault == "posinf":
        row[POSINF_COL] = math.inf
        return None
    if fault == "all_nan":
        row[:] = math.nan
        return None
    if fault == "all_neginf":
        row[:] = -math.inf
        return None
    if fault == "neginf_mask":
        row[MASK_COLS] = -math.inf
        masked[FAULT_ROW, MASK_COLS] = -math.inf
        return masked
    raise ValueError(fault)


def sample(
    engine: Engine,
    logits: torch.Tensor,
    mode: str,
    *,
    return_logprob: bool = False,
    seed: int = 1234,
) -> tuple[torch.Tensor, Any]:
    """SGLang's Sampler.forward on `logits` (modified in place, as SGLang does); returns the
    ids and the LogitsProcessorOutput (logprobs land there)."""
    rows, vocab = logits.shape
    output = engine.LogitsProcessorOutput(next_token_logits=logits)
    info = batch_info(engine, mode, rows, vocab)
    torch.manual_seed(seed)  # the pytorch backend samples with torch.multinomial
    ids = engine.sampler(
        output,
        info,
        return_logprob,
        [0] * rows,
        [None] * rows,
        torch.zeros(rows, dtype=torch.int64),
    )
    return ids, output


def describe(ids: torch.Tensor, what: str = "") -> str:
    text = f"ids {ids.tolist()}"
    return f"{text}: {what}" if what else text


def try_sample(engine: Engine, logits: torch.Tensor, mode: str, **kwargs: Any) -> tuple[Any, str]:
    """(ids or None, short observed text): an exception is observed, not raised."""
    try:
        ids, _ = sample(engine, logits, mode, **kwargs)
    except Exception as exc:  # the unguarded engine's own crash is what is observed
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return ids, describe(ids)


def profile_settings(**environ: str) -> GuardSettings:
    return GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE), **environ})


@contextmanager
def guarded(*, hooks: bool = True, registry: Any = None, **environ: str) -> Iterator[Guardrails]:
    """The profile's attach points and hooks on a fresh Guardrails (own metrics registry, or
    `registry`), removed again on exit: what `guardrails run` installs, in this process."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry() if registry is None else registry
    guards = Guardrails(profile_settings(**environ), registry=registry)
    handles: list[Any] = []
    try:
        handles += guards.attach_configured()
        if hooks:
            handles += guards.install_hooks()
        yield guards
    finally:
        for handle in reversed(handles):
            handle.remove()
        guards.close()
