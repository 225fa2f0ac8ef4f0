"""The logprob oracle RL needs: the engine against the trainer, position by position.

The trainer is transformers itself: a model of the served architecture with transformers'
default initialisation (what a trainer starts from, not siesta's own random init), pushed into
the engine (``update_weights`` with its state dict) or saved and loaded as a checkpoint. Both
score the same tokens: a prompt's (prompt logprobs) and the ones the engine then decodes
greedily (their logprobs as sampled). The unit of error is the trainer's own noise floor: the
same transformers model in bf16 against itself in fp32, on the same tokens. Errors are the
largest |logprob difference| in buckets of positions up to 32k.

The GPU run (``bash bench/gpu.sh --sections fidelity``) scores four architectures at batch 1
and at batch 64 (the long prompt among 63 shorter ones); the CPU suite runs the same code on
small models in fp32 (``tests/bench/test_fidelity.py``).
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from siesta.bench.common import release_memory

BUCKETS = ((1, 64), (64, 256), (256, 1024), (1024, 4096), (4096, 8192), (8192, 16384), (16384, 32768))
REF_CHUNK_ROWS = 2048  # rows of logits a reference takes at a time: [rows, vocab] in fp32
# Query rows a reference forward attends with at a time, over transformers' own KV cache: in fp32
# torch's SDPA takes its math kernel, whose score matrix for a whole 32k prompt is 64 GiB.
REF_FORWARD_ROWS = 2048
DECODE_TOKENS = 16
SHORT_PROMPTS = (64, 1024)  # the batch's other prompts: lengths drawn uniformly from this range
# transformers' rotary buffers: a trainer loading bf16 weights keeps them in fp32 (a whole-model
# .to(bfloat16) would round them, and its own floor would then grow with the position).
ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def trainer_model(config: PretrainedConfig, device: str | torch.device, seed: int = 0) -> torch.nn.Module:
    """transformers' model of ``config`` with transformers' own initialisation, in fp32."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def bf16_twin(model: torch.nn.Module, config: PretrainedConfig) -> torch.nn.Module:
    """The same weights in bf16, as a trainer running bf16 holds them (rotary tables in fp32)."""
    device = next(model.parameters()).device
    with torch.device(device):
        twin = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    fp32_buffers = dict(model.named_buffers())
    for name, buf in twin.named_buffers():
        if name.rsplit(".", 1)[-1] in ROTARY_BUFFERS:
            buf.data = fp32_buffers[name].detach().clone()
    return twin.eval()


@torch.inference_mode()
def token_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[: i + 1]) for every position i, in float64 from the model's logits."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    cache = DynamicCache(config=model.config)
    parts = [model.model(tokens[:, i : i + REF_FORWARD_ROWS], past_key_values=cache, use_cache=True).last_hidden_state[0]
             for i in range(0, len(ids), REF_FORWARD_ROWS)]  # fmt: skip
    hidden = torch.cat(parts)
    del cache, parts
    targets = tokens[0, 1:]
    out: list[float] = []
    for start in range(0, len(ids) - 1, REF_CHUNK_ROWS):
        end = min(start + REF_CHUNK_ROWS, len(ids) - 1)
        logits = model.lm_head(hidden[start:end]).double()
        picked = logits.gather(1, targets[start:end, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        out.extend(picked.tolist())
    return out


@dataclass
class Scored:
    """One request's engine logprobs by position: prompt positions 0..n-2, then its decoded tokens."""

    prompt: list[int]
    generated: list[int]
    prompt_lp: list[float]  # position i scores prompt[i + 1]
    decode_lp: list[float]  # position n - 1 + j scores generated[j]
    # A mixture-of-experts engine's routing, where asked: [positions, layers, k] (dense layers -1).
    routing: np.ndarray | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated


def engine_scores(llm, prompts: list[list[int]], decode_tokens: int = DECODE_TOKENS,
                  routing: bool = False) -> list[Scored]:  # fmt: skip
    """The engine's prompt logprobs and greedy decode logprobs for ``prompts``, all in one batch;
    with ``routing``, each request's routed experts too."""
    from siesta import SamplingParams

    params = SamplingParams(max_tokens=decode_tokens, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True,
                            return_routed_experts=routing)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scored = []
    for p, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        prompt_lp = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        decode_lp = [gen.logprobs[j][t].logprob for j, t in enumerate(gen.token_ids)]
        routed = gen.routed_experts.array() if routing else None
        scored.append(Scored(p, list(gen.token_ids), prompt_lp, decode_lp, routed))
    return scored


@contextlib.contextmanager
def captured_routers(model: torch.nn.Module, on: bool = True) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Each sparse layer's router over the forwards run inside, as transformers computes it: its
    probabilities (fp32 softmax of the logits, ``[positions, experts]``) and the top-k it picked
    (``[positions, k]``, on the model's own ties), on the CPU; filled in when the block ends.
    Read off ``token_logprobs``' own forward, so routing costs no second pass."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if not on:
        yield captured
        return
    parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def keep(layer: int):
        def hook(_module, _args, out) -> None:
            logits, _, picked = out
            parts.setdefault(layer, []).append((torch.softmax(logits.float(), -1).cpu(), picked.cpu()))

        return hook

    gates = {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    handles = [gate.register_forward_hook(keep(i)) for i, gate in gates.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
    captured.update({i: (torch.cat([p for p, _ in got]), torch.cat([k for _, k in got])) for i, got in parts.items()})


def _deficits(picked: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per position, how far below the fp32 router's k-th probability the lowest of ``picked``
    (``[positions, k]``) lies: 0 where every pick is in the fp32 top k, else the margin the pick
    crossed. A swap inside the top k changes nothing an expert layer sums."""
    k = picked.shape[1]
    kth = probs.topk(k, -1).values[:, -1]
    return (kth - probs.gather(1, picked.long()).min(-1).values).clamp(min=0)


def routing_report(scored: list[Scored], fp32: dict[tuple, dict], bf16: dict[tuple, dict]) -> dict[str, Any]:
    """The engine's top-k sets against transformers fp32's, per (position, sparse layer): how many
    differ, and how many of those crossed a wider fp32 margin than transformers bf16 itself
    crossed on the same tokens (its widest: the floor). Those beyond the floor are the engine's."""
    decisions = engine_differs = twin_differs = 0
    engine_gaps: list[torch.Tensor] = []
    floor = 0.0
    for s in scored:
        key = tuple(s.ids)
        rows = s.routing.shape[0]
        for layer, (probs, _) in fp32[key].items():
            p = probs[:rows]
            engine = _deficits(torch.from_numpy(s.routing[:, layer].astype("int64")), p)
            twin = _deficits(bf16[key][layer][1][:rows], p)
            decisions += rows
            engine_differs += int((engine > 0).sum())
            twin_differs += int((twin > 0).sum())
            engine_gaps.append(engine[engine > 0])
            floor = max(floor, float(twin.max()))
    gaps = torch.cat(engine_gaps) if engine_gaps else torch.zeros(0)
    return {"decisions": decisions, "engine_differs": engine_differs, "trainer_bf16_differs": twin_differs,
            "floor_margin": floor, "engine_beyond_floor": int((gaps > floor).sum()),
            "engine_widest_margin": float(gaps.max()) if gaps.numel() else 0.0}  # fmt: skip


def _reference(model: torch.nn.Module, seqs: set[tuple[int, ...]], routing: bool) -> tuple[dict, dict]:
    """``model``'s logprobs of each sequence and, with ``routing``, its routers' choices on it."""
    logprobs, routers = {}, {}
    for ids in seqs:
        with captured_routers(model, routing) as routers[ids]:
            logprobs[ids] = token_logprobs(model, list(ids))
    return logprobs, routers


def bucket_of(position: int) -> str:
    for lo, hi in BUCKETS:
        if position < hi:
            return f"{lo}-{hi}"
    return f"{BUCKETS[-1][1]}+"


def errors_by_bucket(scored: list[Scored], refs: list[list[float]], others: list[list[float]]) -> dict[str, Any]:
    """Per kind (prompt, decode) and bucket: the largest |engine - fp32 reference| and the largest
    |other - fp32 reference| (the floor, when ``others`` is transformers in bf16), and their ratio."""
    worst: dict[str, dict[str, list[float]]] = {"prompt": {}, "decode": {}}
    for s, ref, other in zip(scored, refs, others, strict=True):
        n = len(s.prompt)
        rows = [("prompt", i, s.prompt_lp[i]) for i in range(n - 1)]
        rows += [("decode", n - 1 + j, lp) for j, lp in enumerate(s.decode_lp)]
        for kind, pos, lp in rows:
            if pos >= len(ref):
                continue  # the last decoded token is scored by no reference position
            cell = worst[kind].setdefault(bucket_of(pos), [0.0, 0.0, 0])
            cell[0] = max(cell[0], abs(lp - ref[pos]))
            cell[1] = max(cell[1], abs(other[pos] - ref[pos]))
            cell[2] += 1
    return {kind: {b: {"siesta": c[0], "floor": c[1], "ratio": c[0] / c[1] if c[1] else None, "positions": c[2]}
                   for b, c in sorted(cells.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))}
            for kind, cells in worst.items()}  # fmt: skip


def worst_ratio(report: dict[str, Any]) -> float | None:
    ratios = [c["ratio"] for cells in report.values() for c in cells.values() if c["ratio"] is not None]
    return max(ratios) if ratios else None


def max_error(report: dict[str, Any]) -> float:
    return max(c["siesta"] for cells in report.values() for c in cells.values())


def random_prompt(length: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def batch_prompts(long_len: int, batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The long prompt first, then ``batch - 1`` shorter ones."""
    rng = random.Random(seed)
    lo, hi = min(SHORT_PROMPTS[0], long_len), min(SHORT_PROMPTS[1], long_len)
    return [random_prompt(long_len, vocab, rng)] + [
        random_prompt(rng.randint(lo, hi), vocab, rng) for _ in range(batch - 1)]  # fmt: skip


def config_folder(config: PretrainedConfig, into: Path) -> str:
    """``random:DIR`` serving exactly the trainer's architecture (its config.json)."""
    config.save_pretrained(into)
    return f"random:{into}"


def run_shape(name: str, config: PretrainedConfig, *, device: str, long_len: int, batch: int, engine_dtype: str,
              kv_cache_bytes: int, checkpoint: bool = False, head_fp32: bool = False,
              served: PretrainedConfig | None = None, engine_kw: dict[str, Any] | None = None,
              probe=None, decode_tokens: int = DECODE_TOKENS, routing: bool = False) -> dict[str, Any]:  # fmt: skip
    """One architecture: the trainer's weights pushed into a fresh engine (and, with ``checkpoint``,
    loaded from a saved checkpoint), scored at batch 1 and at ``batch`` against the trainer.
    ``served``: the config the engine serves, when it is not the trainer's (to show a mismatch).
    ``probe(llm)``: more measurements of the pushed engine (a dict), after its scores.
    ``decode_tokens``: each request's greedy tokens; the long prompt's bucket holds that many
    decoded positions, so its maximum (the engine's and the floor's) is over that many samples.
    ``routing`` (a mixture-of-experts model): the engine's routed experts against the trainer's
    router in fp32, with the trainer's bf16 twin as the floor (``routing_report``)."""
    from siesta import LLM

    t0 = time.perf_counter()
    trainer = trainer_model(config, device)
    prompts = batch_prompts(long_len, batch, config.vocab_size)
    kw = {"dtype": engine_dtype, "device": device, "kv_cache_bytes": kv_cache_bytes, "enable_sleep_mode": False,
          "max_model_len": long_len + 2 * decode_tokens} | (engine_kw or {})  # fmt: skip
    if head_fp32:
        kw["head_dtype"] = "float32"
    if routing:
        kw["enable_return_routed_experts"] = True
    runs: dict[str, list[Scored]] = {}
    with tempfile.TemporaryDirectory(prefix="siesta-fidelity-") as tmp:
        llm = LLM(config_folder(served or config, Path(tmp) / "config"), **kw)
        numerics_key = llm.engine.numerics_key  # where /metrics finds this report (siesta.fidelity_report)
        llm.update_weights(trainer.state_dict())  # the trainer's push: its tensors, its names
        runs["push_batch1"] = engine_scores(llm, prompts[:1], decode_tokens, routing)
        if batch > 1:
            runs[f"push_batch{batch}"] = engine_scores(llm, prompts, decode_tokens, routing)
        probed = probe(llm) if probe is not None else None
        del llm
        release_memory()
        if checkpoint:
            saved = torch.bfloat16 if engine_dtype == "bfloat16" else torch.float32
            # The trainer's weights as it would save them, the trainer itself left in fp32.
            trainer.save_pretrained(Path(tmp) / "ckpt", state_dict={k: v.to(saved) for k, v in trainer.state_dict().items()})
            llm = LLM(str(Path(tmp) / "ckpt"), **kw)
            runs["checkpoint_batch1"] = engine_scores(llm, prompts[:1], decode_tokens, routing)
            del llm
            release_memory()
    engine_s = time.perf_counter() - t0
    # References on each run's own tokens (the decoded ones may differ between runs).
    seqs = {tuple(s.ids) for scored in runs.values() for s in scored}
    ref, routers = _reference(trainer, seqs, routing)
    twin = bf16_twin(trainer, config)
    del trainer
    release_memory()
    floor, twin_routers = _reference(twin, seqs, routing)
    del twin
    release_memory()
    out: dict[str, Any] = {"shape": name, "long_prompt": long_len, "engine_dtype": engine_dtype, "head_fp32": head_fp32,
                           "decode_tokens": decode_tokens, "numerics_key": numerics_key, "engine_s": engine_s,
                           "total_s": time.perf_counter() - t0}  # fmt: skip
    if probed is not None:
        out["probe"] = probed
    for run, scored in runs.items():
        report = errors_by_bucket(scored, [ref[tuple(s.ids)] for s in scored], [floor[tuple(s.ids)] for s in scored])
        out[run] = {"buckets": report, "worst_ratio": worst_ratio(report), "max_error": max_error(report)}
        if routing:
            out[run]["routing"] = routing_report(scored, routers, twin_routers)
    if "checkpoint_batch1" in runs:  # the push and the checkpoint put the same weights in place
        out["push_equals_checkpoint"] = [s.prompt_lp for s in runs["push_batch1"]] == [
            s.prompt_lp for s in runs["checkpoint_batch1"]]  # fmt: skip
    return out



def summary_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for key, shape in results.items():
        if not isinstance(shape, dict) or "shape" not in shape:
            continue
        for run in [r for r in shape if r.startswith(("push_batch", "checkpoint_batch"))]:
            rows.append([f"logprobs vs trainer fp32 / its bf16 floor: {key} {run}", shape[run]["worst_ratio"],
                         f"goal <= 1.5 in every bucket to {shape['long_prompt']:,} tokens; max |diff| "
                         f"{shape[run]['max_error']:.3f}"])  # fmt: skip
    return rows


def dumps(results: dict[str, Any]) -> str:
    return json.dumps(results, indent=1, default=str)
