"""The operand checks the Triton linears share (``triton_gemv``, ``triton_matmul``): ``x`` ``[M, K]``
and ``weight`` ``[N, K]`` of one supported dtype on one device, each contiguous along K, and a
contiguous ``bias`` ``[N]`` beside them. ``op`` names the kernel in the messages."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_linear_operands(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          dtypes: Sequence[torch.dtype], max_rows: int | None = None) -> None:  # fmt: skip
    """ValueError naming what is wrong; ``max_rows``: the most rows of x the kernel takes."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{op} needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: K mismatch, x is {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if max_rows is not None and x.shape[0] > max_rows:
        raise ValueError(f"{op} takes at most {max_rows} rows, got {x.shape[0]}: use a GEMM")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{op} needs x and weight contiguous along K (stride 1 in the last dimension)")
    if x.dtype != weight.dtype or x.dtype not in dtypes:
        raise ValueError(f"{op} needs x and weight of one dtype among {tuple(dtypes)}, got {x.dtype}, {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"{op}: x is on {x.device} and weight on {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.stride(0) != 1:
            raise ValueError(f"{op} needs a contiguous bias of shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} and x on {x.device}")
