"""Bisect the GPU logprob drift (issue 36, H200 runs 45a-b): a transformers-initialised Llama-3
shape (4 layers) or Qwen3-0.6B, saved and served as a checkpoint, prompt and decode logprobs
against transformers fp32, under switches that turn GPU-only paths off one at a time, and with
the engine's config.json given another rope than the trainer's.

    PYTHONPATH=. python3 bench/fidelity_probe.py 8192        # SHAPE=qwen3, ARMS=bf16,fp32, LAYERS=4
"""

import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

LAYERS = int(os.environ.get("LAYERS", "4"))
OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = os.environ.get("SMALL") == "1"


SHAPE = os.environ.get("SHAPE", "llama")


def config():
    if SHAPE == "qwen3":
        return AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                    max_position_embeddings=40960, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    w = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2) if SMALL else dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                                       num_attention_heads=32, num_key_value_heads=8)
    return AutoConfig.for_model("llama", **w, num_hidden_layers=LAYERS,
                                max_position_embeddings=131072, rms_norm_eps=1e-5,
                                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192},
                                tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)


class TorchOps:
    @staticmethod
    def rms_norm(x, w, eps):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return w * x32.to(dtype)

    @staticmethod
    def fused_add_rms_norm(x, res, w, eps):
        s = x + res
        return TorchOps.rms_norm(s, w, eps), s

    @staticmethod
    def apply_rope(q, k, pos, cos, sin):
        c = cos[pos].to(q.dtype)[:, None, :]
        s = sin[pos].to(q.dtype)[:, None, :]

        def rot(x):
            h = x.shape[-1] // 2
            return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

        return q * c + rot(q) * s, k * c + rot(k) * s

    @staticmethod
    def silu_and_mul(gu):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u


def run_engine(path, prompt, n_dec, dtype, torch_ops=False, gemv=True, **kw):
    import siesta.model.layers as L
    from siesta import LLM, SamplingParams

    saved = (L._triton_ops, L.GEMV_ROWS)
    if torch_ops:
        L._triton_ops = lambda: TorchOps
    if not gemv:
        L.GEMV_ROWS = 0
    try:
        llm = LLM(path, dtype=dtype, kv_cache_bytes=8 << 30, max_model_len=16384, enable_sleep_mode=False, **kw)
        p = SamplingParams(max_tokens=n_dec, logprobs=0, prompt_logprobs=0, temperature=0, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]
        toks = out.outputs[0].token_ids
        plp = [None] + [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        dlp = [out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(toks)]
        del llm
    finally:
        L._triton_ops, L.GEMV_ROWS = saved
        gc.collect()
        torch.cuda.empty_cache() if DEV == "cuda" else None
    return toks, plp, dlp


def ref_logprobs(model, ids):
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=DEV)).logits[0].float()
    return torch.log_softmax(logits.double(), -1)


ARMS = [
    ("bf16-engine-rope-default", "bfloat16", {}),
    ("bf16", "bfloat16", {}),
    ("fp32", "float32", {}),
    ("fp32-eager-sync", "float32", {"enforce_eager": True, "async_scheduling": False}),
    ("fp32-eager-sync-torchattn", "float32", {"enforce_eager": True, "async_scheduling": False,
                                               "attention_backend": "torch"}),
    ("fp32-torchops-nogemv", "float32", {"torch_ops": True, "gemv": False}),
    ("fp32-all-off", "float32", {"torch_ops": True, "gemv": False, "enforce_eager": True,
                                 "async_scheduling": False, "attention_backend": "torch"}),
]

BUCKETS = [(1, 64), (64, 256), (256, 1024), (1024, 4096), (4096, 16384)]


def score(ref, prompt, toks, plp, dlp):
    n = len(prompt)
    res = {}
    pe = [abs(plp[i] - ref[i - 1, prompt[i]].item()) for i in range(1, n)]
    for a, b in BUCKETS:
        if a < n:
            res[f"p{a}-{b}"] = max(pe[a - 1:b - 1])
    res["decode"] = max(abs(dlp[j] - ref[n - 1 + j, t].item()) for j, t in enumerate(toks))
    return res


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    n_dec = 8
    cfg = config()
    torch.manual_seed(0)
    t0 = time.time()
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(DEV).eval()
    path = tempfile.mkdtemp(prefix="fid-")
    hf.save_pretrained(path)
    print(f"model built+saved {time.time() - t0:.1f}s", flush=True)
    prompt = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    results = {}
    arms = [a for a in ARMS if a[0] in os.environ.get("ARMS", ",".join(a[0] for a in ARMS)).split(",")]
    for name, dtype, kw in arms:
        t0 = time.time()
        where = path
        if name == "bf16-engine-rope-default":  # the engine's config says theta 10000, the trainer's llama3
            where = tempfile.mkdtemp(prefix="fid-mismatch-")
            for f in os.listdir(path):
                if f != "config.json":
                    os.symlink(os.path.join(path, f), os.path.join(where, f))
            c = json.load(open(os.path.join(path, "config.json")))
            c.pop("rope_scaling", None)
            c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
            c["rope_theta"] = 10000.0
            json.dump(c, open(os.path.join(where, "config.json"), "w"))
        try:
            toks, plp, dlp = run_engine(where, prompt, n_dec, dtype, **kw)
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": repr(e)[:500]}
            print(name, "ERROR", repr(e)[:300], flush=True)
            continue
        ref = ref_logprobs(hf, prompt + toks)
        results[name] = score(ref, prompt, toks, plp, dlp)
        print(name, f"{time.time() - t0:.1f}s", json.dumps({k: round(v, 4) for k, v in results[name].items()}), flush=True)
    # floor: transformers bf16 against fp32 on the engine's bf16 tokens
    # Loaded in bf16 as a trainer loads it: from_pretrained keeps the rotary inv_freq in fp32
    # (a .to(bfloat16) of the whole module would round it too).
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
    print("hf16 inv_freq dtype", [b.dtype for n, b in hf16.named_buffers() if "inv_freq" in n][:1], flush=True)
    toks = [0] * 0
    ref = ref_logprobs(hf, prompt)
    lo = ref_logprobs(hf16, prompt)
    pe = [abs(lo[i - 1, prompt[i]].item() - ref[i - 1, prompt[i]].item()) for i in range(1, n)]
    results["floor"] = {f"p{a}-{b}": max(pe[a - 1:b - 1]) for a, b in BUCKETS if a < n}
    print("floor", json.dumps({k: round(v, 4) for k, v in results["floor"].items()}), flush=True)
    with open(os.path.join(OUT, f"fid_probe_{SHAPE}_{n}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
