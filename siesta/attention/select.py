"""Picking an attention backend by name: above the backends, which build on ``base``."""

from __future__ import annotations

import torch

from siesta.attention.base import AttentionBackend


def get_attention_backend(name: str, device: torch.device, deterministic: bool = False,
                          kv_quantized: bool = False) -> AttentionBackend:  # fmt: skip
    """``auto`` takes the Triton kernels on CUDA and, elsewhere, the torch reference with
    its decode rows read in place by a compiled kernel (``cpu_attention``). ``deterministic``:
    the batch-invariant variant of the device's own (one kernel, one tiling for every row).
    ``kv_quantized`` (an fp8 cache): on the CPU, the torch reference itself, by design: the C
    kernels read fp32 caches only, and the reference dequantizes in torch."""
    if deterministic:
        if name == "torch":
            raise ValueError("deterministic mode has no torch attention backend: use auto")
        if device.type == "cuda":
            from siesta.attention.triton_attention import BatchInvariantTritonAttention

            return BatchInvariantTritonAttention()
        from siesta.attention.cpu_attention import BatchInvariantCpuAttention

        return BatchInvariantCpuAttention()
    if name == "auto" and device.type != "cuda" and kv_quantized:
        name = "torch"
    if name == "auto" and device.type != "cuda":
        from siesta.attention.cpu_attention import CpuAttention

        return CpuAttention()
    if name == "auto":
        name = "triton"
    if name == "torch":
        from siesta.attention.torch_ref import TorchAttention

        return TorchAttention()
    if name == "triton":
        from siesta.attention.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}: expected auto, torch or triton")
