"""Detect + count + heal implementations, one per kind of device.

Every logits kernel has the signature of `LogitsKernel`: it reads `x` ([..., V], at least one
row; V may be 0), writes one uint8 flag per row into `flags`, adds its counts into the int64
buffer `counts` (layout `guardrails.flags.LOGITS_SLOTS`) and, if `spec.sanitize`, heals `x` in
place. No kernel may allocate memory proportional to `x` on its clean path, and the CUDA ones
may not synchronise with the host.

- `reference`: branch-free torch, any layout: the CUDA path when Triton is missing and the
  fast kernels' fallback (the tests hold every kernel to an oracle of their own).
- `cpu`: one reduction for a clean batch, exact work only on the chunks it flags.
- `triton_impl`: one fused launch on CUDA (optional extra `guardrails-logits[triton]`).
- `token_ids`: the out-of-vocab token-id guard (one branch-free pass, any device).
- `values`: the replacement values and the rule that keeps them finite after `/ T`.

May import `guardrails.flags` and torch; nothing else of guardrails.
"""

from guardrails.kernels.base import HealSpec, LogitsKernel, as_rows
from guardrails.kernels.select import select_logits_kernel

__all__ = ["HealSpec", "LogitsKernel", "as_rows", "select_logits_kernel"]
