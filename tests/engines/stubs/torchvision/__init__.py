"""STUB of torchvision, for the real-engine suites only (tests/engines/): not torchvision.

Why: SGLang imports torchvision at module level in its multimodal helpers
(`sglang.srt.multimodal.internvl_utils`, reached from `sglang.srt.configs` through the memory
pool that `sglang.srt.layers.sampler` imports). The registry's torchvision wheel requires a
CUDA build of torch, which these CPU venvs must never pull. No sampling, speculative or
scheduler code path calls torchvision: every name here imports, and any call raises
RuntimeError, so a test that strays onto an image path fails instead of passing on a fake.
`tests/engines/sglang/conftest.py` puts this directory on sys.path; nothing installs it.
There is no dist-info, so `importlib.metadata` (transformers' availability check) still
reports torchvision as not installed.
"""

from torchvision._unavailable import module_getattr

__version__ = "0.0.0+stub"
__getattr__ = module_getattr("torchvision")
