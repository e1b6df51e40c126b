"""The vLLM suite's V1 half runs in this process; `v2/` runs in its own (`.ci/engines/run.sh`
starts `pytest tests/engines/vllm/v2` separately).

Model Runner V2's Triton kernels run on the CPU only when TRITON_INTERPRET=1 and an empty
CUDA_VISIBLE_DEVICES are set before vLLM is imported, and vLLM's CPU shim
(`vllm.v1.worker.cpu.shm`) patches torch process-wide. Both change what the V1 tests here run
(with Triton usable, V1's top-k/top-p takes its Triton kernel), so the two halves never share
a process.
"""

from __future__ import annotations

collect_ignore = ["v2"]
