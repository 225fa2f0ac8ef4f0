"""The Llama family's checkpoint names: Hugging Face's, with q/k/v and gate/up landing in the
fused ``qkv_proj`` and ``gate_up_proj`` (whose own names are taken too, as a trainer that fused
them sends them)."""

from __future__ import annotations

import functools

from siesta.model.kv_scales import is_kv_scale_name
from siesta.model.weights import CheckpointPart

# Checkpoint names seen by weight pushes (every push repeats the model's few hundred).
CHECKPOINT_NAME_CACHE = 4096
SHARDS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}  # fmt: skip
SKIPPED = ("rotary_emb",)  # computed, never loaded


@functools.lru_cache(maxsize=CHECKPOINT_NAME_CACHE)
def map_checkpoint_name(name: str) -> CheckpointPart | None:
    """HF name -> the parameter it lands in (and the part of a fused one); None for tensors the
    model does not keep."""
    if any(skipped in name for skipped in SKIPPED):
        return None
    if is_kv_scale_name(name):  # read by the KV cache (fp8), not a parameter: model/kv_scales.py
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in SHARDS:
        fused, shard = SHARDS[parts[-2]]
        return CheckpointPart(".".join([*parts[:-2], fused, parts[-1]]), shard)
    return CheckpointPart(name)


def checkpoint_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """A transformers parameter as a checkpoint stores it: the same, for this family."""
    return [(name, shape)]
