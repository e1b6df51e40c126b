"""Which kernel guards tensors on a device: imported lazily, so that the CPU path never
imports Triton and a CUDA machine without Triton still has the reference."""

from __future__ import annotations

import torch

from guardrails.kernels.base import LogitsKernel

__all__ = ["select_logits_kernel"]


def select_logits_kernel(device: torch.device) -> LogitsKernel:
    """The fastest available implementation for tensors on `device`."""
    if device.type == "cpu":
        from guardrails.kernels._cpu import CPU_KERNEL

        return CPU_KERNEL
    if device.type == "cuda":
        from guardrails.kernels.triton_impl import kernel as triton_kernel

        kernel = triton_kernel()
        if kernel is not None:
            return kernel
    from guardrails.kernels.reference import REFERENCE_KERNEL

    return REFERENCE_KERNEL
