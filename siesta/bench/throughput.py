"""``siesta bench throughput``: siesta against transformers' batched ``generate``.

Both arms get the same weights (loaded from the same source), the same dtype and
the same random token-id prompts, in one process. Reported: output tok/s of each
arm and their ratio; prefill tok/s at one long prompt; decode tok/s at fixed
batch sizes (time of N+1 generated tokens minus time of 1, per token).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from siesta.bench.common import print_table, random_prompts, write_json
from siesta.sampling import SamplingParams

PREEMPTIONS = "siesta_num_preemptions_total"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=100)
    p.add_argument("--max-prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2000)
    p.add_argument("--decode-batches", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--decode-context", type=int, default=128, help="prompt length for the decode runs")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")


# -- siesta ------------------------------------------------------------------------------


def _siesta_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0


def _siesta_arm(llm, args: argparse.Namespace, prompts: list[list[int]], vocab: int) -> dict[str, Any]:
    _siesta_generate(llm, random_prompts(2, 16, 32, vocab, seed=99), 4)  # warm-up
    preempted = llm.get_metrics().get(PREEMPTIONS, 0.0)
    elapsed = _siesta_generate(llm, prompts, args.output_len)
    res = {"elapsed_s": elapsed, "output_tok_s": len(prompts) * args.output_len / elapsed}
    # Recomputed work, which a KV cache too small for the batch costs (see --kv-cache-bytes).
    res["preemptions"] = llm.get_metrics().get(PREEMPTIONS, 0.0) - preempted
    long_prompt = random_prompts(1, args.prefill_len, args.prefill_len, vocab, seed=1)
    res["prefill_tok_s"] = args.prefill_len / _siesta_generate(llm, long_prompt, 1)
    for b in _batches(args):
        ps = random_prompts(b, args.decode_context, args.decode_context, vocab, seed=100 + b)
        t1 = _siesta_generate(llm, ps, 1)
        ps = random_prompts(b, args.decode_context, args.decode_context, vocab, seed=200 + b)
        tn = _siesta_generate(llm, ps, args.decode_steps + 1)
        res[f"decode_tok_s_batch{b}"] = b * args.decode_steps / max(tn - t1, 1e-9)
    return res


# -- transformers --------------------------------------------------------------------------


def _hf_model(source, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    # Built on the device itself: ``to_empty`` from meta would leave the rotary buffers unset.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype)
    state = dict(source.iter_weights(dtype, device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise RuntimeError(f"transformers model mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def _hf_generate(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    longest = max(len(p) for p in prompts)
    device = model.device
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, longest - len(p) :] = torch.tensor(p, device=device)
        mask[i, longest - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False, pad_token_id=pad_id)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _hf_arm(model, args: argparse.Namespace, prompts: list[list[int]], vocab: int, pad_id: int) -> dict[str, Any]:
    _hf_generate(model, random_prompts(2, 16, 32, vocab, seed=99), 4, pad_id)
    elapsed = _hf_generate(model, prompts, args.output_len, pad_id)
    res = {"elapsed_s": elapsed, "output_tok_s": len(prompts) * args.output_len / elapsed}
    long_prompt = random_prompts(1, args.prefill_len, args.prefill_len, vocab, seed=1)
    res["prefill_tok_s"] = args.prefill_len / _hf_generate(model, long_prompt, 1, pad_id)
    for b in _batches(args):
        ps = random_prompts(b, args.decode_context, args.decode_context, vocab, seed=100 + b)
        t1 = _hf_generate(model, ps, 1, pad_id)
        tn = _hf_generate(model, ps, args.decode_steps + 1, pad_id)
        res[f"decode_tok_s_batch{b}"] = b * args.decode_steps / max(tn - t1, 1e-9)
    return res


def _batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.decode_batches.split(",") if b]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from siesta import LLM
    from siesta.entrypoints.engine_args import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    vocab = llm.engine.vocab_size
    prompts = random_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.prompt_seed)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output tokens each; "
          f"dtype {llm.engine.runner.dtype}, device {llm.engine.runner.device}, {torch.get_num_threads()} threads")  # fmt: skip
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    result: dict[str, Any] = {"config": config | {"dtype_resolved": str(llm.engine.runner.dtype)}}
    print("siesta arm ...", flush=True)
    result["siesta"] = _siesta_arm(llm, args, prompts, vocab)
    print(f"siesta: {result['siesta']}", flush=True)
    source, dtype, device = llm.engine.source, llm.engine.runner.dtype, llm.engine.runner.device
    del llm
    gc.collect()
    if not args.skip_transformers:
        pad_id = (source.eos_token_ids or [0])[0]
        print("transformers arm ...", flush=True)
        result["transformers"] = _hf_arm(_hf_model(source, dtype, device), args, prompts, vocab, pad_id)
    _report(result)
    write_json(args.json, result)
    return result


def _report(result: dict[str, Any]) -> None:
    arms = [a for a in ("siesta", "transformers") if a in result]
    keys = [k for k in result["siesta"] if k not in ("elapsed_s", "preemptions")]
    rows = []
    for k in keys:
        row = [k, *(result[a][k] for a in arms)]
        if len(arms) == 2:
            row.append(result["siesta"][k] / result["transformers"][k])
        rows.append(row)
    headers = ["metric", *arms] + (["siesta / transformers"] if len(arms) == 2 else [])
    print_table("throughput (tok/s)", headers, rows)
    print(f"siesta preempted {result['siesta']['preemptions']:.0f} times")
