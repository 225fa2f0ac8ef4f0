"""Engines with an fp8 KV cache (``kv_cache_dtype="fp8"``) on the CPU: a float64 oracle that
quantizes K/V the same way, prefill against decode on the same tokens, the blocks a byte budget
buys, and a sleep that keeps the tier.

The oracle is transformers' model of the same weights in float64, its attention reading K/V
written and read back through ``tests/fp8_oracle.py`` (the quantization computed by hand) under
the checkpoint's own scales.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import hf_twin
from fp8_oracle import oracle_dequantized
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from siesta import LLM, SamplingParams
from siesta.attention.kv_quant import KVScales
from siesta.model.loader import resolve_model

MODEL = "random:tiny-llama"
LAYERS, VOCAB = 2, 1024
FP8 = torch.float8_e4m3fn
# Per-layer scales the checkpoint ships (fp32 values, so exact as written); 1.0 elsewhere.
K_SCALES, V_SCALES = (0.0712890625, 0.09375), (0.0400390625, 0.123046875)
ORACLE = "siesta_fp8_kv_oracle"
TOP_N = 3
CHUNK = 48  # max_num_batched_tokens: longer prompts prefill in chunks that read earlier ones from the cache
# fp32 engine against its float64 oracle (measured up to 2e-6), and a prompt chunk against
# decode rows over the same fp8 blocks (measured up to 1e-6): fp32 noise.
ATOL = 2e-5
# Against a float64 model that does not quantize, the same engine is off by 0.1-0.2: the oracle
# sees the quantization, so agreeing with it to ATOL is not agreeing with everything.
UNQUANTIZED_GAP = 1e-2
TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"block_size": 32, "cpu_bytes_to_use": 1 << 22}}  # fmt: skip
LOAD_BYTES = 'siesta_kv_offload_load_bytes_total{tier="host"}'


def engine(model: str = MODEL, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_bytes": 1 << 22, "max_model_len": 512, "max_num_batched_tokens": CHUNK} | kw
    return LLM(model, **kw)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run(llm: LLM, ps: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """tiny-llama's random weights as a Hugging Face folder that ships K and V cache scales."""
    folder = tmp_path_factory.mktemp("fp8-scales")
    hf_twin(resolve_model(MODEL)).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    for layer in range(LAYERS):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(K_SCALES[layer])
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(V_SCALES[layer])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _fp8_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention over K/V as an fp8 cache under the checkpoint's scales holds them."""
    layer = module.layer_idx
    key = oracle_dequantized(key, K_SCALES[layer], FP8)
    value = oracle_dequantized(value, V_SCALES[layer], FP8)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(scope="module")
def models():
    """(the float64 oracle that quantizes K/V, the same model in float64 that does not)."""
    AttentionInterface.register(ORACLE, _fp8_attention)
    plain = hf_twin(resolve_model(MODEL)).double()
    oracle = copy.deepcopy(plain)  # its own config: the attention is chosen there
    oracle.config._attn_implementation = ORACLE
    return oracle, plain


def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    """Row i scores token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def errors(out, prompt: list[int], ref: torch.Tensor) -> tuple[float, float]:
    """Largest |logprob - oracle| over the prompt's scored tokens (their top-n too), and over the
    sampled tokens, which must be the oracle's argmax up to ATOL."""
    prompt_err = 0.0
    for i in range(1, len(prompt)):
        for token, lp in out.prompt_logprobs[i].items():
            prompt_err = max(prompt_err, abs(lp.logprob - ref[i - 1, token].item()))
    decode_err = 0.0
    for j, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert row[token] >= row.max() - ATOL, "a greedy token the oracle does not rank first"
        decode_err = max(decode_err, *(abs(lp.logprob - row[t].item()) for t, lp in entry.items()))
    return prompt_err, decode_err


def test_an_fp8_engine_is_a_float64_model_that_quantizes_kv_the_same_way(checkpoint, models) -> None:
    oracle, plain = models
    llm = engine(str(checkpoint), kv_cache_dtype="fp8")
    kv = llm.engine.runner.kv_cache
    assert kv.tensor.dtype == FP8 and kv.scales == KVScales.of(K_SCALES, V_SCALES, origin="checkpoint")
    ps = prompts(130, 41)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP_N, prompt_logprobs=TOP_N)
    for prompt, out in zip(ps, run(llm, ps, params), strict=True):
        ids = prompt + out.outputs[0].token_ids
        assert max(errors(out, prompt, logprobs_of(oracle, ids))) < ATOL
        # The oracle is not merely close to any model: without quantizing it is far off.
        scored = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        unquantized = logprobs_of(plain, ids)[torch.arange(len(prompt) - 1), prompt[1:]]
        assert (torch.tensor(scored, dtype=torch.float64) - unquantized).abs().max() > UNQUANTIZED_GAP


def test_an_auto_engine_loads_a_checkpoint_with_kv_scales_and_leaves_them_alone(checkpoint) -> None:
    llm = engine(str(checkpoint))
    assert llm.engine.runner.kv_cache.tensor.dtype == torch.float32 and llm.engine.runner.kv_cache.scales is None
    reference = engine(MODEL)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = prompts(60)
    tokens = [[o.outputs[0].token_ids for o in run(each, ps, params)] for each in (llm, reference)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_prompt_logprobs_and_decode_logprobs_of_the_same_tokens_agree(backend: str) -> None:
    """vLLM issue 54035: with fp8 KV, prefill attended to its own chunk's unquantized K/V and
    decode to the quantized cache. The tokens an engine decoded, scored again as a prompt (in
    chunks of CHUNK), get the logprobs decode gave them, to fp32 noise."""
    llm = engine(kv_cache_dtype="fp8", attention_backend=backend)
    prompt = prompts(37, seed=1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    decoded = run(llm, [prompt], greedy)[0].outputs[0]
    ids = prompt + decoded.token_ids
    rescored = run(llm, [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    gaps = [abs(rescored[len(prompt) + j][token].logprob - entry[token].logprob)
            for j, (token, entry) in enumerate(zip(decoded.token_ids, decoded.logprobs, strict=True))]  # fmt: skip
    assert max(gaps) < ATOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_byte_budget_buys_blocks_and_tier_entries_by_the_element_size(dtype: str) -> None:
    """fp8 holds twice bf16's tokens (four times fp32's) in the same device and tier bytes, and
    a bf16 engine computes with it (dequantized to bf16)."""
    auto, fp8 = (engine(dtype=dtype, kv_cache_dtype=name, kv_transfer_config=TIER) for name in ("auto", "fp8"))
    ratio = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    assert fp8.engine.runner.num_blocks == ratio * auto.engine.runner.num_blocks
    assert fp8.engine.connector.host.capacity == ratio * auto.engine.connector.host.capacity
    assert fp8.engine.connector.host.entry_bytes * ratio == auto.engine.connector.host.entry_bytes
    out = run(fp8, prompts(50), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4


def test_sleep_keeping_the_tier_then_wake_and_resume_gives_the_uninterrupted_tokens() -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ps = prompts(40, 75, 130, seed=2)
    reference = [o.outputs[0].token_ids for o in run(engine(kv_cache_dtype="fp8"), ps, params)]
    llm = engine(kv_cache_dtype="fp8", kv_transfer_config=TIER)
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in ps]
    for _ in range(6):
        llm.step()
    assert llm.has_unfinished_requests()
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    llm.wake_up()
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    assert [done[i] for i in ids] == reference
    assert llm.get_metrics()[LOAD_BYTES] > 0, "the resume loaded fp8 blocks from the tier"
