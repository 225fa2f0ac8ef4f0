"""The arithmetic of one prefill as the engine runs it, for its MFU.

A prompt prefilled for generation (no prompt logprobs) takes logits of its last row only:
``CausalLM.forward``'s ``keep`` runs the last layer's o_proj and MLP, the final norm and the
output head on the kept rows, while every layer before (and the last layer's attention, which
writes every row's K/V) runs on every token. The benches until run 65 counted the head (and the
last layer's o_proj and MLP) on every row, work no kernel does: 5.9 of the 76.2 TFLOP counted for
an 8k Qwen3-30B-A3B prefill (its MFU read 53 % where the work done gives 49 %), 11.8 of 140.6
for Llama-3-8B's.

Matmul FLOPs only (two a multiply-add): the matrices' weights over the rows they see, the
experts at their routed share (top k of the experts), and causal attention (QK^T and PV over
the n(n+1)/2 query-key pairs of each head). Norms, RoPE, softmax and the embedding lookup are
left out, as MFU conventionally does.
"""

from __future__ import annotations

from torch import nn

# Dense bf16 tensor-core peak of the H100 and H200 SXM datasheets (one chip); the measured
# matmul ceiling on the H200 is ~774e12.
BF16_PEAK_FLOPS = 989e12
MEASURED_MATMUL_FLOPS = 774e12
# The stacked experts' parameters (``moe.Experts``): a token reads top_k of num_experts of them.
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
# What the last layer runs on the kept rows alone (``CausalLM.forward``).
_TAIL = ("self_attn.o_proj.", "mlp.")


def prefill_flops(model: nn.Module, tokens: int, kept_rows: int = 1) -> float:
    """Matmul FLOPs of one ``tokens``-long prompt prefilled whole from an empty cache, with
    logits taken for ``kept_rows`` rows (1 when it is prefilled to generate)."""
    shape = model.shape
    last = f"model.layers.{shape.num_layers - 1}."
    routed = shape.top_k / shape.num_experts if getattr(shape, "num_experts", 0) else 1.0
    total = 0.0
    for name, p in model.named_parameters():  # a tied head is the embedding's: counted below
        if p.dim() < 2 or "embed_tokens" in name or name.startswith("lm_head"):
            continue
        rows = kept_rows if name.startswith(last) and name[len(last) :].startswith(_TAIL) else tokens
        share = routed if name.endswith(EXPERT_PARAMS) else 1.0
        total += 2 * p.numel() * share * rows
    head = 2 * shape.vocab_size * shape.hidden_size * kept_rows
    attention = 2 * 2 * shape.num_layers * shape.num_heads * shape.head_dim * tokens * (tokens + 1) / 2
    return total + head + attention


def mfu(flops: float, seconds: float) -> float:
    return flops / seconds / BF16_PEAK_FLOPS
