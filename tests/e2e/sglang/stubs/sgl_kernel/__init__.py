"""STUB of sgl_kernel, for the SGLang real-server suite only (tests/e2e/sglang/): not sgl_kernel.

Why: with its CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`) SGLang 0.5.23 imports
CPU ops from `sgl_kernel` at module level (`sglang.srt.mem_cache.allocation`,
`sglang.kernels.ops.kvcache.cache_move` and the speculative-decoding ops in
`sglang.kernels.ops.speculative`), and the registry has no CPU build of sgl-kernel (its
wheels are CUDA-only, with no sdist). The suite serves with `--attention-backend
torch_native`, no speculative decoding and page size 1: none of these functions is called
there, so each name below imports, and any call raises NotImplementedError, so a server that
strays onto one of these kernels fails its request instead of passing on a fake.

Only the names SGLang imports from this module are here (found by serving the suite's
requests): nothing else, in particular no `convert_weight_packed` and no `torch.ops.sgl_kernel`
op is registered, so SGLang's check for Intel AMX kernels
(`hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`) is false and it builds its
native-PyTorch layers. `tests/e2e/sglang/launch.py` puts this directory on the server's
PYTHONPATH; nothing installs it, and there is no dist-info.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+stub"

_NAMES = (
    # sglang.srt.mem_cache.allocation
    "assign_req_to_token_pool_cpu",
    # sglang.kernels.ops.kvcache.cache_move
    "copy_all_layer_kv_cache_cpu",
    # sglang.kernels.ops.speculative (cache_locs, eagle, spec_tree)
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def _unavailable(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is a stub (tests/e2e/sglang/stubs/sgl_kernel): the suite's "
            "server never calls an sgl-kernel CPU op; a call here means it left the "
            "torch_native path"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


globals().update({name: _unavailable(name) for name in _NAMES})
__all__ = list(_NAMES)
