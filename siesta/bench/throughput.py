"""``siesta bench throughput``: siesta against transformers' batched ``generate``.

Both arms get the same weights (loaded from the same source), the same dtype and
the same random token-id prompts, in one process, and run interleaved: each
measurement is taken for siesta and for transformers back to back (their order
alternating from repeat to repeat), ``--repeats`` times, and the medians are
reported with their ratio. On a machine shared with other work both arms then see
the same load; the load average before and after the run is recorded.

Measured:
- output tok/s of each mix (``--mix``): ``decode-heavy`` (64 prompts of 100-1,000
  tokens, 128 new tokens each) and ``prefill-heavy`` (32 prompts of 150-1,000 tokens,
  64 new tokens each, about 9 prompt tokens per output token);
- prefill tok/s of one ``--prefill-len`` prompt (one new token);
- decode tok/s at fixed batch sizes (time of N+1 generated tokens minus time of 1, per token).

Every repeat uses fresh prompts (another seed), so siesta's prefix cache never serves a
prompt it computed in an earlier repeat.

siesta's engine writes its whole KV pool at start-up here (``--prefault-kv-cache``; turn it
off with ``--no-prefault-kv-cache``), as vLLM's zeroed cache is and as a server's pool is
once it has gone round: the bench times steady state. Without it, every repeat's blocks
are fresh pages of the 4 GB pool, which a VM whose host backs memory lazily faults in at
about 4 s a GB (2-core Xeon VM, 2026-12-03: 4-5 s of a 38 s prefill-heavy run).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from siesta.bench.common import machine, print_table, random_prompts, write_json
from siesta.cpu_info import cpu_model
from siesta.sampling import SamplingParams

PREEMPTIONS = "siesta_num_preemptions_total"
ARMS = ("siesta", "transformers")
# Seeds of one repeat's prompts: repeat r adds r * REPEAT_SEED_STRIDE to each, so no two
# repeats (nor the mixes, the long prompt and the decode batches) share a prompt.
REPEAT_SEED_STRIDE = 1000
LONG_PROMPT_SEED, DECODE_SEED_ONE, DECODE_SEED_MANY, MIX_SEED_OFFSET = 1, 100, 200, 300


@dataclass(frozen=True)
class Mix:
    """A batch of random prompts and how many tokens each generates."""

    name: str
    num_prompts: int
    min_prompt_len: int
    max_prompt_len: int
    output_len: int


MIXES = {
    "decode-heavy": Mix("decode-heavy", num_prompts=64, min_prompt_len=100, max_prompt_len=1000, output_len=128),
    "prefill-heavy": Mix("prefill-heavy", num_prompts=32, min_prompt_len=150, max_prompt_len=1000, output_len=64),
}
MIX_CHOICES = (*MIXES, "both")
# Engine flags this bench sets otherwise than ``siesta serve`` does (see the docstring).
ENGINE_DEFAULTS = {"prefault_kv_cache": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mix", choices=MIX_CHOICES, default="both", help="which prompt mix(es) to time")
    # Each overrides that field of every mix run (None: the mix's own value).
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--min-prompt-len", type=int, default=None)
    p.add_argument("--max-prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--prefill-len", type=int, default=2000)
    p.add_argument("--decode-batches", default="1,64", help="comma-separated batch sizes ('' for none)")
    p.add_argument("--decode-context", type=int, default=128, help="prompt length for the decode runs")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every measurement")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")


def selected_mixes(args: argparse.Namespace) -> list[Mix]:
    names = list(MIXES) if args.mix == "both" else [args.mix]
    overrides = {f: getattr(args, f) for f in ("num_prompts", "min_prompt_len", "max_prompt_len", "output_len")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return [dataclasses.replace(MIXES[n], **overrides) for n in names]


# -- the two arms: each times "generate these prompts, max_tokens each" -----------------------


class SiestaArm:
    def __init__(self, llm) -> None:
        self.llm = llm

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    def preemptions(self) -> float:
        return self.llm.get_metrics().get(PREEMPTIONS, 0.0)


class TransformersArm:
    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        longest = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as batched generation needs
            ids[i, longest - len(p) :] = torch.tensor(p, device=device)
            mask[i, longest - len(p) :] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad_id)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


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


# -- measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One figure (tok/s) taken from an arm with prompts of one repeat."""

    key: str
    run: Callable[[Any, int], float]  # (arm, repeat) -> tok/s


def measurements(args: argparse.Namespace, vocab: int) -> list[Measurement]:
    def seed(base: int, repeat: int) -> int:
        return args.prompt_seed + base + repeat * REPEAT_SEED_STRIDE

    out: list[Measurement] = []
    for i, mix in enumerate(selected_mixes(args)):

        def mix_run(arm, repeat: int, mix: Mix = mix, i: int = i) -> float:
            ps = random_prompts(mix.num_prompts, mix.min_prompt_len, mix.max_prompt_len, vocab,
                                seed(MIX_SEED_OFFSET + i, repeat))  # fmt: skip
            return len(ps) * mix.output_len / arm.generate(ps, mix.output_len)

        out.append(Measurement(f"{mix.name}_output_tok_s", mix_run))

    def prefill_run(arm, repeat: int) -> float:
        ps = random_prompts(1, args.prefill_len, args.prefill_len, vocab, seed(LONG_PROMPT_SEED, repeat))
        return args.prefill_len / arm.generate(ps, 1)

    out.append(Measurement(f"prefill_{args.prefill_len}_tok_s", prefill_run))
    for b in _batches(args):

        def decode_run(arm, repeat: int, b: int = b) -> float:
            ctx = args.decode_context
            t1 = arm.generate(random_prompts(b, ctx, ctx, vocab, seed(DECODE_SEED_ONE + b, repeat)), 1)
            tn = arm.generate(random_prompts(b, ctx, ctx, vocab, seed(DECODE_SEED_MANY + b, repeat)), args.decode_steps + 1)  # fmt: skip
            return b * args.decode_steps / max(tn - t1, 1e-9)

        out.append(Measurement(f"decode_tok_s_batch{b}", decode_run))
    return out


def _batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.decode_batches.split(",") if b]


Samples = dict[str, dict[str, list[float]]]  # arm -> measurement -> one figure per repeat


def interleave(arms: dict[str, Any], todo: list[Measurement], repeats: int,
               after_repeat: Callable[[Samples], None] | None = None) -> Samples:  # fmt: skip
    """Every measurement ``repeats`` times, each arm right after the other (order alternating).
    ``after_repeat`` sees the samples so far once each repeat is complete."""
    samples: Samples = {name: {m.key: [] for m in todo} for name in arms}
    for repeat in range(repeats):
        for m in todo:
            order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
            for name in order:
                samples[name][m.key].append(m.run(arms[name], repeat))
                print(f"repeat {repeat}: {name} {m.key} {samples[name][m.key][-1]:,.1f}", flush=True)
        if after_repeat is not None:
            after_repeat(samples)
    return samples


def summarize(result: dict[str, Any], samples: Samples) -> None:
    """Medians of each arm and their ratios into ``result``, beside the samples they come from."""
    for name, per_key in samples.items():
        result.setdefault(name, {}).update({k: statistics.median(v) for k, v in per_key.items() if v})
        result[f"{name}_samples"] = per_key
    if "transformers" in samples:
        result["ratios"] = {k: result["siesta"][k] / result["transformers"][k] for k in result["transformers"]}


def _load() -> list[float]:
    return list(os.getloadavg())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from siesta import LLM
    from siesta.entrypoints.engine_args import engine_kwargs

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    start_s = time.perf_counter() - t0
    vocab = llm.engine.vocab_size
    source, dtype, device = llm.engine.source, llm.engine.runner.dtype, llm.engine.runner.device
    print(f"{cpu_model()}: dtype {dtype}, device {device}, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats; "
          f"mixes {[dataclasses.asdict(m) for m in selected_mixes(args)]}")  # fmt: skip
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    result: dict[str, Any] = {
        "config": config | {"dtype_resolved": str(dtype), "threads": torch.get_num_threads()},
        "mixes": [dataclasses.asdict(m) for m in selected_mixes(args)],
        "machine": machine(),
        "load_average_before": _load(),
        "siesta_start_s": start_s,  # with the pool's pages written, under --prefault-kv-cache
    }
    arms: dict[str, Any] = {"siesta": SiestaArm(llm)}
    if not args.skip_transformers:
        arms["transformers"] = TransformersArm(_hf_model(source, dtype, device), (source.eos_token_ids or [0])[0])
    warmup = random_prompts(2, 16, 32, vocab, seed=99)
    for arm in arms.values():
        arm.generate(warmup, 4)
    preempted = arms["siesta"].preemptions()

    def checkpoint(samples: Samples) -> None:  # a long run on a busy machine keeps what it measured
        summarize(result, samples)
        result["repeats_done"] = len(next(iter(samples["siesta"].values())))
        result["load_average_after"] = _load()
        write_json(args.json, result)

    samples = interleave(arms, measurements(args, vocab), args.repeats, checkpoint)
    summarize(result, samples)
    result["load_average_after"] = _load()
    # Recomputed work, which a KV cache too small for the batch costs (see --kv-cache-bytes).
    result["siesta"]["preemptions"] = arms["siesta"].preemptions() - preempted
    del arms, llm
    gc.collect()
    _report(result)
    write_json(args.json, result)
    return result


def _report(result: dict[str, Any]) -> None:
    arms = [a for a in ARMS if a in result]
    rows = []
    for k in result["siesta_samples"]:
        if k not in result["siesta"]:
            continue
        row = [k, *(result[a][k] for a in arms)]
        if "ratios" in result:
            row.append(result["ratios"][k])
        rows.append(row)
    headers = ["metric (median tok/s)", *arms] + (["siesta / transformers"] if "ratios" in result else [])
    print_table("throughput (tok/s)", headers, rows)
    prefault = result["config"].get("prefault_kv_cache")
    pool = f"written at start-up ({result['siesta_start_s']:.1f} s to start)" if prefault else "committed as first used"
    print(f"siesta's KV pool {pool}; "
          f"preempted {result['siesta']['preemptions']:.0f} times; load average (1, 5, 15 min) "
          f"{result['load_average_before']} before, {result['load_average_after']} after")  # fmt: skip
