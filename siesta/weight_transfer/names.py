"""A trainer's parameter names and tensors, as the engine takes them.

Training wrappers rename parameters (``module.`` from DDP, ``_orig_mod.`` from
``torch.compile``, FSDP's wrapped modules); tied weights appear twice. ``checkpoint_tensors``
gives each weight once, under its Hugging Face name; with ``fuse`` it also joins q/k/v and
gate/up into the engine's fused ``qkv_proj`` and ``gate_up_proj`` (one tensor and one copy
each, instead of three and two).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
SKIPPED = ("rotary_emb.",)
NAME_CACHE_SIZE = 1 << 17  # names: Qwen3-235B-A22B pushes ~36k per-expert tensors a step
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PART_OF = {part: (fused, parts) for fused, parts in FUSED.items() for part in parts}

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def checkpoint_name(name: str) -> str:
    """``module._orig_mod.model.layers.0...`` -> ``model.layers.0...``."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


def named_tensors(weights: Any) -> NamedTensors:
    """A module, a state dict or (name, tensor) pairs, as (name, tensor) pairs."""
    if isinstance(weights, torch.nn.Module):
        return weights.named_parameters()
    if isinstance(weights, Mapping):
        return weights.items()
    return weights


def checkpoint_tensors(
    weights: Any, dtype: torch.dtype | None = None, fuse: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight once, detached and contiguous, under its checkpoint name (cast to ``dtype``)."""
    stream = _renamed(named_tensors(weights))
    if fuse:
        stream = _fused(stream)
    for name, tensor in stream:
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor.contiguous()


@functools.lru_cache(maxsize=NAME_CACHE_SIZE)
def _kept_name(raw: str) -> str | None:
    """``checkpoint_name(raw)``, or None for a tensor that does not travel. Cached: a trainer
    pushes the same names every step, and a per-expert MoE push is ~10k of them (renaming took
    ~90 ms of a 20-layer Qwen3-30B-A3B push on an H100's host, run 61c)."""
    name = checkpoint_name(raw)
    return None if any(s in name for s in SKIPPED) else name


def _renamed(pairs: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    embedding: torch.Tensor | None = None  # held, so its address cannot be reused meanwhile
    for raw, tensor in pairs:
        name = _kept_name(raw)
        if name is None:
            continue
        if name == EMBEDDING:
            embedding = tensor
        elif name == HEAD and embedding is not None and _same_memory(tensor, embedding):
            continue  # tied to the embedding: the engine ties them too
        # Out of autograd (a module's parameters); a state dict's tensors are out already, and
        # detaching ~19k of them each push cost 0.27 s under the profiler here.
        yield name, tensor.detach() if tensor.requires_grad else tensor


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _fused(pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Joins the parts of each fused projection once all of them have come by."""
    pending: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in pairs:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in _PART_OF:
            yield name, tensor
            continue
        fused, members = _PART_OF[parts[-2]]
        prefix, kind = ".".join(parts[:-2]), parts[-1]
        group = pending.setdefault((prefix, fused, kind), {})
        group[parts[-2]] = tensor
        if len(group) == len(members):
            del pending[(prefix, fused, kind)]
            yield f"{prefix}.{fused}.{kind}", torch.cat([group[m] for m in members], dim=0)
    for (prefix, _, kind), group in pending.items():  # an incomplete group travels unfused
        for member, tensor in group.items():
            yield f"{prefix}.{member}.{kind}", tensor
