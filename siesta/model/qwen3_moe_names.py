"""Qwen3-MoE's checkpoint names: the Llama family's (``llama_names``) for attention, norms,
embedding, head and any dense MLP layer, and the experts under every scheme trainers use.

- Per expert, as checkpoints store them: ``mlp.experts.E.{gate,up}_proj.weight`` ``[I, H]``
  and ``mlp.experts.E.down_proj.weight`` ``[H, I]``;
- per expert with gate and up joined (siesta's own sender with ``fuse``):
  ``mlp.experts.E.gate_up_proj.weight`` ``[2I, H]``;
- stacked, as transformers 5 models hold them (what FSDP trainers push):
  ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``.

They all land in the stacked parameters ``mlp.experts.gate_up_proj`` / ``down_proj``; the
router is ``mlp.gate.weight`` under every scheme. Matched before the dense mapping, which would
read ``experts.7.gate_proj`` as a dense MLP's gate.
"""

from __future__ import annotations

import functools
import re

from siesta.model import llama_names
from siesta.model.weights import CheckpointPart

GATE_UP, DOWN = "gate_up_proj", "down_proj"
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|gate_up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_SHARD = {"gate_proj": "gate", "up_proj": "up", "gate_up_proj": None, "down_proj": None}
_PARAM = {"gate_proj": GATE_UP, "up_proj": GATE_UP, "gate_up_proj": GATE_UP, "down_proj": DOWN}


@functools.lru_cache(maxsize=llama_names.CHECKPOINT_NAME_CACHE * 8)  # 128 experts x 3 per layer
def map_checkpoint_name(name: str) -> CheckpointPart | None:
    match = _PER_EXPERT.match(name)
    if match:
        proj = match["proj"]
        return CheckpointPart(f"{match['prefix']}.{_PARAM[proj]}", _SHARD[proj], int(match["expert"]))
    match = _STACKED.match(name)
    if match:
        return CheckpointPart(f"{match['prefix']}.{match['proj']}")
    return llama_names.map_checkpoint_name(name)


def checkpoint_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """A transformers parameter as a checkpoint stores it: a stacked expert tensor as its
    experts' own tensors (what ``save_pretrained`` writes for Qwen3-MoE), anything else as is."""
    match = _STACKED.match(name)
    if match is None:
        return [(name, shape)]
    prefix, experts = match["prefix"], shape[0]
    if match["proj"] == DOWN:  # [E, H, I]
        return [(f"{prefix}.{e}.down_proj.weight", shape[1:]) for e in range(experts)]
    rows, hidden = shape[1] // 2, shape[2]  # [E, 2I, H], gate rows first
    return [(f"{prefix}.{e}.{proj}.weight", (rows, hidden)) for e in range(experts) for proj in ("gate_proj", "up_proj")]
