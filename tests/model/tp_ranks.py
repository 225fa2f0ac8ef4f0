"""What each rank of a CPU tensor-parallel test runs (spawned processes over gloo), and the step
driver the test also runs at tensor parallel 1: a prefill of several requests into a paged KV
cache, then decode steps, through the torch reference attention.

Decode steps are teacher-forced (fixed next tokens), so every rank, the tensor parallel 1 model
and transformers see the same inputs and their logits compare position by position.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.torch_ref import TorchAttention
from siesta.config import WeightTransferConfig
from siesta.model.llama import CausalLM
from siesta.model.parallel import SINGLE, TensorParallel
from siesta.model.random_init import parameter_layout, random_tensor
from siesta.weight_transfer.group import open_group
from siesta.weight_transfer.handles import shm_handle
from siesta.weight_transfer.receivers import LocalReceiver
from siesta.weight_transfer.updater import WeightUpdater
from siesta.weight_transfer.wire import WeightTransferError

BLOCK_SIZE = 16
MAX_POSITIONS = 256
PROMPTS = [
    [3, 17, 42, 7, 99, 5, 250, 11, 64, 8, 1, 300, 77, 21, 9, 4, 123, 56, 31, 2, 600],
    [12, 400, 33, 71, 8, 990, 14, 5, 27],
]
FORCED = [[45, 18, 700], [6, 222, 91]]  # the next token of each request, per decode step
EMBEDDED = "embedded"  # the SmolLM2 GGUF the package ships

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# Each case stresses one part of the split; vocabularies that 2 (or 4) does not divide get padded.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {**_TINY, "vocab_size": 1024, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    # One KV head for four query heads: every rank holds a copy of it.
    "llama-mqa-tied-odd-vocab": (
        "llama",
        {**_TINY, "vocab_size": 1001, "num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
    "qwen2-bias-tied": ("qwen2", {**_TINY, "vocab_size": 1000, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    # head_dim 32 while hidden / heads is 16; untied, and a vocabulary no tp size divides.
    "qwen3-qk-norm": (
        "qwen3",
        {**_TINY, "vocab_size": 1023, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    ),
}
UPDATE_CASE = "llama-gqa"
TRAINER_SEED, FUSED_SEED, BROADCAST_SEED = 1, 2, 3
LOOPBACK = "127.0.0.1"
RUNNER_MODEL = "random:tiny-llama"  # 2 layers, 2 KV heads of 16
RUNNER_KV_BYTES = 1 << 20
BROADCAST_TIMEOUT_S = 60.0


def case_config(case: str) -> PretrainedConfig:
    model_type, params = CASES[case]
    return AutoConfig.for_model(model_type, **params)


def random_weights(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """Full Hugging Face tensors, the same in every process (seeded by name, as random-init models are)."""
    return {name: random_tensor(name, shape, seed, torch.float32, "cpu") for name, shape in parameter_layout(config)}


def case_weights(case: str) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    if case == EMBEDDED:
        from siesta.model.loader import resolve_model

        source = resolve_model(None)
        return source.hf_config, dict(source.iter_weights(torch.float32, "cpu"))
    config = case_config(case)
    return config, random_weights(config, seed=0)


def build(config: PretrainedConfig, weights: dict[str, torch.Tensor], tp: TensorParallel = SINGLE) -> CausalLM:
    """As the model runner builds it: on the meta device, materialised uninitialised, then loaded."""
    with torch.device("meta"):
        model = CausalLM(config, MAX_POSITIONS, TorchAttention(), tp)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    model.model.rotary.build_tables(None)
    written = model.load_weights(weights.items())
    missing = model.expected_weight_names() - written
    assert not missing, f"not loaded: {sorted(missing)[:5]}"
    return model.eval()


def run_steps(model: CausalLM, prompts=PROMPTS, forced=FORCED) -> list[torch.Tensor]:
    """Logits of the prefill (every prompt row, requests end to end) and of each decode step."""
    local, n = model.local, len(prompts)
    per_request = -(-(max(map(len, prompts)) + len(forced[0])) // BLOCK_SIZE)
    cache = KVCache.allocate(n * per_request, local.num_layers, BLOCK_SIZE, local.num_kv_heads, local.head_dim,
                             torch.float32, torch.device("cpu"))  # fmt: skip
    # Requests' blocks interleaved and reversed, so a wrong block table reads another's KV.
    tables = torch.arange(n * per_request, dtype=torch.int32).flip(0).view(per_request, n).t().contiguous()

    def step(tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        ids = [t for toks in tokens for t in toks]
        positions = [s + j for toks, s in zip(tokens, starts) for j in range(len(toks))]
        slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for i, (toks, s) in enumerate(zip(tokens, starts)) for p in range(s, s + len(toks))]  # fmt: skip
        seq_lens = [s + len(toks) for toks, s in zip(tokens, starts)]
        query_starts = [0]
        for toks in tokens:
            query_starts.append(query_starts[-1] + len(toks))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(map(len, tokens)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_starts,
            seq_lens_cpu=seq_lens,
        )
        hidden = model(torch.tensor(ids), torch.tensor(positions), cache, meta)
        return model.compute_logits(hidden)

    with torch.inference_mode():
        out = [step(prompts, [0] * n)]
        for s in range(len(forced[0])):
            out.append(step([[f[s]] for f in forced], [len(p) + s for p in prompts]))
    return out


def hf_model(config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def hf_steps(hf: torch.nn.Module, prompts=PROMPTS, forced=FORCED) -> list[torch.Tensor]:
    """transformers' logits at the positions ``run_steps`` computes, one request at a time (no padding)."""
    per_request = []
    with torch.inference_mode():
        for prompt, more in zip(prompts, forced):
            per_request.append(hf(torch.tensor([prompt + more])).logits[0].float())
    out = [torch.cat([logits[: len(p)] for logits, p in zip(per_request, prompts)])]
    for s in range(len(forced[0])):
        out.append(torch.stack([logits[len(p) + s] for logits, p in zip(per_request, prompts)]))
    return out


# -- what each spawned rank runs -----------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A tensor-parallel group of the first ``size`` ranks, the cases it runs, and whether it then
    runs the weight updates (given the trainer's shm declaration and group port, in a JSON file;
    the world's last rank, outside the group, is then the trainer that broadcasts)."""

    size: int
    cases: tuple[str, ...]
    updates: str | None = None


def rank_main(rank: int, world: int, store_path: str, out_dir: str, jobs: list[Job]) -> None:
    """Join the gloo world, then run each job in a group of its first ranks (the world, or a
    subgroup: ``TensorParallel.group``); rank 0 saves the logits, every rank what it holds.
    One world for every job: a process costs seconds of imports on two shared cores."""
    torch.set_num_threads(1)  # the ranks share two cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: the ranks are on this host
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    out = Path(out_dir)
    try:
        for job in jobs:
            # Every rank of the world takes part in creating a group, members or not.
            group = None if job.size == world else dist.new_group(list(range(job.size)))
            if rank >= job.size:
                if job.updates is not None and rank == world - 1:
                    _broadcasting_trainer(json.loads(Path(job.updates).read_text())["master_port"], job.size)
                continue
            tp = TensorParallel(rank=rank, size=job.size, group=group)
            for case in job.cases:
                config, weights = case_weights(case)
                model = build(config, weights, tp)
                logits = run_steps(model)
                if rank == 0:
                    torch.save(logits, out / f"tp{job.size}.{case}.logits.pt")
                torch.save(asdict(model.local), out / f"tp{job.size}.{case}.local.{rank}.pt")
            if job.updates is not None:
                torch.save(_weight_updates(tp, job.updates), out / f"tp{job.size}.updates.{rank}.pt")
                torch.save(runner_kv_cache(tp), out / f"tp{job.size}.runner.{rank}.pt")
    except BaseException:
        (out / f"error.{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def runner_kv_cache(tp: TensorParallel) -> dict[str, Any]:
    """The model runner's KV cache on this rank: its shape and the block count its bytes buy."""
    from siesta.config import EngineConfig
    from siesta.core.model_runner import ModelRunner
    from siesta.model.loader import resolve_model

    config = EngineConfig.from_flags(model=RUNNER_MODEL, dtype="float32", kv_cache_bytes=RUNNER_KV_BYTES, device="cpu",
                                     attention_backend="torch", enable_sleep_mode=False)  # fmt: skip
    runner = ModelRunner(config, resolve_model(RUNNER_MODEL), MAX_POSITIONS, tp)
    return {"shape": tuple(runner.kv_cache.tensor.shape), "local": asdict(runner.model.local)}


def write_shm_weights(path: str, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The trainer's side of an ipc push on the CPU: every tensor's bytes in one /dev/shm file,
    declared unpacked (one handle per tensor)."""
    names, shapes, handles, offset = [], [], [], 0
    with open(path, "wb") as f:
        for name, tensor in weights.items():
            data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            f.write(data)
            names.append(name)
            shapes.append(list(tensor.shape))
            handles.append(shm_handle(path, offset, len(data)))
            offset += len(data)
    return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": shapes, "ipc_handles": handles}


def fused_update(seed: int) -> dict[str, torch.Tensor]:
    """Layer 1's q|k|v and gate|up as the trainer's fused names, whole."""
    w = random_weights(case_config(UPDATE_CASE), seed)
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    return {
        f"{attn}.qkv_proj.weight": torch.cat([w[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
        f"{mlp}.gate_up_proj.weight": torch.cat([w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]]),
    }


def _weight_updates(tp: TensorParallel, shm_info_path: str) -> dict[str, Any]:
    """Pushes of full tensors into this rank's model through the updater: refused ones write
    nothing; accepted ones leave this rank's slices (the test checks them by hand)."""
    config = case_config(UPDATE_CASE)
    model = build(config, random_weights(config, seed=0), tp)
    updater = WeightUpdater(WeightTransferConfig(backend="ipc"), model, torch.device("cpu"))
    updater.init_engine({})
    result: dict[str, Any] = {}
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # A declared shape that is this rank's shard, not the full tensor: refused before any byte.
    name = "model.layers.0.self_attn.q_proj.weight"
    shard_shape = list(model.weight_target(name).view.shape)
    updater.start()
    try:
        updater.receive({"names": [name], "dtype_names": ["float32"], "shapes": [shard_shape], "ipc_handles": [{}]})
        result["shard_shape_refusal"] = None
    except WeightTransferError as e:
        result["shard_shape_refusal"] = str(e)
    try:
        updater.write({name: torch.zeros(shard_shape), "model.norm.weight": torch.zeros(config.hidden_size)})
        result["mapping_refusal"] = None
    except ValueError as e:
        result["mapping_refusal"] = str(e)
    after = model.state_dict()
    result["unchanged_after_refusals"] = all(torch.equal(before[k], after[k]) for k in before)

    # Every tensor, unfused, from the trainer's shared memory (the ipc path on the CPU).
    declared = json.loads(Path(shm_info_path).read_text())
    updater.receive(declared["shm"])
    result["logits_after_push"] = run_steps(model)[0]  # every rank runs the forward: it has collectives
    result["state_after_push"] = {k: v.clone() for k, v in model.state_dict().items()}

    # Fused tensors, whole, handed over in process (the path SGLang's tensors take).
    fused = fused_update(FUSED_SEED)
    info = {
        "names": list(fused),
        "dtype_names": ["float32"] * len(fused),
        "shapes": [list(t.shape) for t in fused.values()],
    }
    updater.state.close()
    updater.start()  # a new update: its written keys are the fused push's alone
    updater.receive(info, LocalReceiver(updater.config, updater.device, list(fused.values())))
    result["fused_written"] = sorted(updater.state.written)
    result["state_after_fused"] = {k: v.clone() for k, v in model.state_dict().items()}
    updater.state.close()

    # Every tensor broadcast by a trainer in a group of its own (the nccl backend, gloo here):
    # each engine rank receives the full bytes and keeps its slice.
    weights = random_weights(config, BROADCAST_SEED)
    broadcast = WeightUpdater(WeightTransferConfig(backend="nccl", timeout_s=BROADCAST_TIMEOUT_S), model,
                              torch.device("cpu"), local_rank=tp.rank)  # fmt: skip
    broadcast.init_engine({"master_address": LOOPBACK, "master_port": declared["master_port"], "rank_offset": 1,
                           "world_size": tp.size + 1})  # fmt: skip
    broadcast.start()
    broadcast.receive({"names": list(weights), "dtype_names": ["float32"] * len(weights),
                       "shapes": [list(t.shape) for t in weights.values()]})  # fmt: skip
    broadcast.state.close()
    broadcast.close()
    result["state_after_broadcast"] = {k: v.clone() for k, v in model.state_dict().items()}
    return result


def _broadcasting_trainer(port: int, engine_ranks: int) -> None:
    """The trainer's side of the nccl backend: rank 0 of its group, each full tensor in turn."""
    group = open_group(LOOPBACK, port, 0, engine_ranks + 1, torch.device("cpu"), BROADCAST_TIMEOUT_S)
    try:
        for tensor in random_weights(case_config(UPDATE_CASE), BROADCAST_SEED).values():
            group.broadcast(tensor)
    finally:
        group.close()


def spawn(world: int, tmp: Path, jobs: list[Job]) -> None:
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(world, str(tmp / "store"), str(tmp), jobs), nprocs=world, join=True)
