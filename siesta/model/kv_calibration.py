"""fp8 KV cache scales computed from the weights, for a checkpoint that ships none
(``--calculate-kv-scales``, vLLM's flag).

vLLM's ``calculate_kv_scales`` measures the first batch the engine serves, so what a block's bytes
mean would depend on which traffic came first. Here the engine measures a fixed prompt instead,
once at start, before the cache exists: ``CALIBRATION_TOKENS`` token ids drawn from the vocabulary
with a fixed seed, one prefill through the model, K and V caught where they are written (after
rotary and any k-norm, as the cache would store them), the largest |K| and |V| of each layer. A
layer's scale is that amax over vLLM's targets for e4m3 (K 200, V 100 of its 448): the stored
values then use the format's range with 2.2x / 4.5x headroom for prompts that reach past the
calibration's. For e5m2 the targets keep the same headroom under its larger maximum.

The scales depend on the weights alone (the same model gives the same scales, on every rank:
the amax is taken over tensor-parallel ranks) and stay for the engine's life, as a checkpoint's
do: the decode graphs capture them, and a weight push that moves the values a little keeps its
headroom. Random tokens are not text, so a real prompt's largest K may pass the calibration's;
the headroom is for that, and past it values saturate at the format's maximum, as in vLLM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from siesta.attention.base import AttentionBackend, AttentionMetadata, KVCache
from siesta.attention.kv_quant import FP8_GRIDS, KVScales
from siesta.attention.torch_ref import TorchAttention
from siesta.parallel import TensorParallel

CALCULATED = "calculated"
CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT, for e4m3's maximum of 448.
E4M3_MAX = 448.0
K_TARGET_E4M3 = 200.0
V_TARGET_E4M3 = 100.0


class _Recorder(AttentionBackend):
    """Attends through the torch reference and keeps each layer's largest |K| and |V|."""

    name = "calibration"

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.inner = TorchAttention()
        self.amax = torch.zeros(2, num_layers, dtype=torch.float32, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer_idx: int,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        self.amax[0, layer_idx] = torch.maximum(self.amax[0, layer_idx], k.detach().abs().max().float())
        self.amax[1, layer_idx] = torch.maximum(self.amax[1, layer_idx], v.detach().abs().max().float())
        return self.inner.forward(q, k, v, kv_cache, layer_idx, meta, scale, out=out)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "layer_idx")]


def _one_prefill(tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    blocks = -(-tokens // block_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(tokens, dtype=torch.int64, device=device),
        max_query_len=tokens,
        max_seq_len=tokens,
        query_start_loc_cpu=[0, tokens],
        seq_lens_cpu=[tokens],
    )


@torch.inference_mode()
def layer_amax(model: torch.nn.Module, vocab_size: int, dtype: torch.dtype, device: torch.device,
               max_tokens: int, block_size: int, tp: TensorParallel) -> torch.Tensor:  # fmt: skip
    """``[2, layers]``: the largest |K| and |V| each layer writes for the calibration prompt."""
    layout = model.kv_layout
    tokens = min(CALIBRATION_TOKENS, max_tokens)
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (tokens,), generator=gen).to(device)
    cache = KVCache.allocate(-(-tokens // block_size), layout.num_layers, block_size, layout.num_kv_heads,
                             layout.head_dim, dtype, device)  # fmt: skip
    recorder = _Recorder(layout.num_layers, device)
    modules = _attention_modules(model)
    saved = [m.backend for m in modules]
    try:
        for m in modules:
            m.backend = recorder
        model(ids, torch.arange(tokens, device=device), cache, _one_prefill(tokens, block_size, device))
    finally:
        for m, backend in zip(modules, saved):
            m.backend = backend
    if tp.size > 1:  # every rank's cache takes the same scales
        dist.all_reduce(recorder.amax, op=dist.ReduceOp.MAX, group=tp.group)
    return recorder.amax.cpu()


def scales_from_amax(amax: torch.Tensor, kv_dtype: torch.dtype) -> KVScales:
    """Each layer's K and V scale for ``amax`` (``[2, layers]``); 1.0 where a layer wrote only zeros."""
    stretch = FP8_GRIDS[kv_dtype].max_value / E4M3_MAX

    def scale(value: float, target: float) -> float:
        return value / (target * stretch) if value > 0 and value < float("inf") else 1.0

    k = [scale(float(a), K_TARGET_E4M3) for a in amax[0]]
    v = [scale(float(a), V_TARGET_E4M3) for a in amax[1]]
    return KVScales.of(k, v, origin=CALCULATED)


def calculate_kv_scales(model: torch.nn.Module, vocab_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                        device: torch.device, max_tokens: int, block_size: int, tp: TensorParallel) -> KVScales:  # fmt: skip
    """The scales of an fp8 cache of ``kv_dtype`` for ``model`` (computing in ``dtype``)."""
    return scales_from_amax(layer_amax(model, vocab_size, dtype, device, max_tokens, block_size, tp), kv_dtype)
