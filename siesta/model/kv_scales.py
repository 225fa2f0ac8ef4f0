"""The fp8 KV cache scales a checkpoint ships, under the names vLLM reads.

Per decoder layer ``L`` (whatever comes before ``layers.L``):

- ``self_attn.k_scale`` / ``self_attn.v_scale``: vLLM's names, which ModelOpt and
  compressed-tensors checkpoints use;
- ``self_attn.k_proj.output_scale`` / ``self_attn.v_proj.output_scale``: older quantizers'
  scales of the K and V projections' outputs, which vLLM remaps to the same;
- ``self_attn.kv_scale``: one scale for both (vLLM's deprecated name).

Each is one value (a per-tensor scale, as vLLM and SGLang apply them): stored = x / scale,
read = stored * scale. Per-head or per-channel scales are refused by name rather than reduced.
Only Hugging Face folders (safetensors) can carry them; a GGUF file or a random model has none,
and without them every scale is 1.0, vLLM's and SGLang's default. A checkpoint that names some
layers' scales but not all is refused: a partial set most likely means names this reader does
not know, and a silent 1.0 for the rest would cost accuracy nobody asked for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open

from siesta.attention.kv_quant import KVScales

_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\."
    r"(?P<kind>k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$"
)
# Which of K and V each name scales.
_ROLES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",), "k_proj.output_scale": ("k",),
    "v_scale": ("v",), "v_proj.output_scale": ("v",),
    "kv_scale": ("k", "v"),
}  # fmt: skip
CHECKPOINT = "checkpoint"


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (the weight loader skips these)."""
    return _SCALE_NAME.search(name) is not None


def checkpoint_kv_scales(files: Sequence[Path], num_layers: int) -> KVScales | None:
    """Every layer's K and V scale from ``files`` (safetensors), or None when they hold none.
    ValueError, naming the tensor or the layers, for scales that are not one value a layer or
    that do not cover every layer."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for path in files:
        with safe_open(path, framework="pt") as reader:
            for name in reader.keys():
                match = _SCALE_NAME.search(name)
                if match is None:
                    continue
                tensor = reader.get_tensor(name)
                if tensor.numel() != 1:
                    raise ValueError(f"{name} holds {tuple(tensor.shape)} values: siesta takes per-tensor KV cache "
                                     "scales, one K and one V value per layer")  # fmt: skip
                for role in _ROLES[match["kind"]]:
                    found[role][int(match["layer"])] = float(tensor.float().item())
    if not found["k"] and not found["v"]:
        return None
    layers = set(range(num_layers))
    for role, scales in found.items():
        if set(scales) != layers:
            missing = sorted(layers - set(scales))[:5]
            extra = sorted(set(scales) - layers)[:5]
            raise ValueError(f"the checkpoint's {role.upper()} cache scales do not cover its {num_layers} layers "
                             f"(missing {missing}, unknown {extra}): give every layer's k_scale and v_scale, "
                             "or none")  # fmt: skip
    return KVScales.of([found["k"][i] for i in range(num_layers)], [found["v"][i] for i in range(num_layers)],
                       origin=CHECKPOINT)  # fmt: skip


def source_kv_scales(files: Sequence[Path] | None, num_layers: int) -> KVScales:
    """The scales of an fp8 KV cache for a model loaded from ``files`` (None: a source without
    safetensors files): the checkpoint's, else 1.0 for every layer."""
    scales = checkpoint_kv_scales(files, num_layers) if files else None
    return scales or KVScales.default(num_layers)
