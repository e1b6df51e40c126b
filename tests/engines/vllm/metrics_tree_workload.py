"""vLLM's own process topology for /metrics, on CPU: run by test_metrics_tree.py, plain and
under `guardrails run --config config/profiles/vllm.toml`.

    python -m tests.engines.vllm.metrics_tree_workload one|several OUT.json

- `one` (vLLM's default, one API server): this process is the API server. It imports vLLM's
  metrics module, builds vLLM's own `PrometheusStatLogger` (vLLM's series in the global
  registry), starts an engine-core process with vLLM's own `get_mp_context()` (spawn or fork,
  as VLLM_WORKER_MULTIPROC_METHOD says), in which vLLM's Sampler samples a batch with NaN
  logits, and scrapes `get_prometheus_registry()` after it.
- `several` (`--api-server-count 2`, as `run_multi_api_server` does): this process calls
  vLLM's `setup_multiprocess_prometheus()`, starts the engine core the same way and two API
  servers with multiprocessing's spawn context (vLLM's `APIServerProcessManager`); each API
  server builds its stat logger, waits for the engine core, and the first scrapes
  `get_prometheus_registry()` (vLLM's MultiProcessCollector over its directory).

The scrape is written to OUT.json as {"scrape": text, "exitcodes": [...]}.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
NAN_ROW = 1  # all NaN: 4096 values
NAN_ENTRIES = (5, 17, 900)  # row 0: three more


def vllm_config(model_dir: str) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            served_model_name="tiny-llama",
            skip_tokenizer_init=True,
            max_model_len=512,
            dtype="float32",
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=16),
        device_config=DeviceConfig(device="cpu"),
    )


def engine_core() -> None:
    """One step of vLLM's own Sampler on NaN logits (guarded where the profile patches it)."""
    from vllm.v1.sample.sampler import Sampler

    from tests.engines.vllm.faults import metadata

    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    logits[0, list(NAN_ENTRIES)] = float("nan")
    logits[NAN_ROW] = float("nan")
    Sampler()(logits, metadata("greedy", rows=3))


def api_server(model_dir: str, engine_done: Any, scrape: bool, out: Any) -> None:
    from prometheus_client import generate_latest
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    PrometheusStatLogger(vllm_config(model_dir), engine_indexes=[0])
    engine_done.wait(240)
    if scrape:
        out.put(generate_latest(get_prometheus_registry()).decode())


def one(model_dir: str) -> dict[str, Any]:
    from prometheus_client import generate_latest
    from vllm.utils.system_utils import get_mp_context
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    PrometheusStatLogger(vllm_config(model_dir), engine_indexes=[0])
    core = get_mp_context().Process(target=engine_core, name="EngineCore_DP0")
    core.start()
    core.join(240)
    return {
        "scrape": generate_latest(get_prometheus_registry()).decode(),
        "exitcodes": [core.exitcode],
    }


def several(model_dir: str) -> dict[str, Any]:
    from vllm.utils.system_utils import get_mp_context
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()
    spawn = multiprocessing.get_context("spawn")
    engine_done = spawn.Event()
    out = spawn.Queue()
    core = get_mp_context().Process(target=engine_core, name="EngineCore_DP0")
    core.start()
    servers = [
        spawn.Process(
            target=api_server, args=(model_dir, engine_done, i == 0, out), name=f"ApiServer_{i}"
        )
        for i in range(2)
    ]
    for server in servers:
        server.start()
    core.join(240)
    engine_done.set()
    text = out.get(timeout=240)
    for server in servers:
        server.join(240)
    return {"scrape": text, "exitcodes": [core.exitcode, *(s.exitcode for s in servers)]}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(MODEL))
        result = one(model_dir) if mode == "one" else several(model_dir)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
