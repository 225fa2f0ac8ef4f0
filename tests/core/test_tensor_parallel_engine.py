"""Tensor parallelism in the engine: real rank processes on gloo, each holding its shard.

The oracle is the same engine at tensor parallel 1 and transformers on the same weights; a
trainer's push is checked against the trainer's own model. Ranks that die or hang are
reported by name within a bound, and nothing is left running.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
from conftest import hf_twin
from weight_transfer.test_weight_updates import assert_matches, trainer_model

from siesta import LLM, SamplingParams
from siesta.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from siesta.core.engine_core import EngineCore
from siesta.distributed.processes import RankFailed
from siesta.model.loader import resolve_model
from siesta.request import EngineCoreRequest
from siesta.weight_transfer import WeightSender

PROMPTS = [[3, 17, 42, 7, 99, 5, 250, 11, 64, 8, 1, 300, 77, 21, 9, 4, 123, 56, 31, 2], [5, 6, 7, 8, 9, 10, 11]]
STEPS = 8
KV_BYTES = 16 << 20
SHAPE = "tiny-llama"
# A rank that died is known from its process at once; one that hangs after its heartbeats stop.
HEARTBEAT_TIMEOUT_S = 2.0
REPORT_BOUND_S = 15.0


def greedy(llm: LLM, prompts=PROMPTS, steps: int = STEPS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy_ids(hf, prompt: list[int], steps: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tp2():
    llm = LLM(f"random:{SHAPE}", dtype="float32", kv_cache_bytes=KV_BYTES, tensor_parallel_size=2,
              weight_transfer_config={"backend": "nccl"})  # fmt: skip
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def reference():
    llm = LLM(f"random:{SHAPE}", dtype="float32", kv_cache_bytes=KV_BYTES)
    return greedy(llm)


def test_tensor_parallel_2_generates_what_1_and_transformers_do(tp2, reference):
    assert tp2.engine.get_world_size() == 2
    assert greedy(tp2) == reference
    hf = hf_twin(resolve_model(f"random:{SHAPE}"))
    assert [hf_greedy_ids(hf, p, STEPS) for p in PROMPTS] == reference


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_reach_every_rank(tp2, reference, level):
    tp2.sleep(level=level)
    tp2.wake_up()
    assert greedy(tp2) == reference


def test_a_trainer_push_reaches_every_rank(tp2, reference):
    hf = trainer_model()
    sender = WeightSender(tp2, "nccl", packed=True, bucket_bytes=64 << 10)
    sender.init()
    try:
        sender.push(hf)
        assert_matches(tp2, hf)
    finally:
        sender.close()
    tp2.update_weights(resolve_model(f"random:{SHAPE}").iter_weights(torch.float32, "cpu"))  # tensors, in process
    assert greedy(tp2) == reference


def _engine(size: int) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=f"random:{SHAPE}", dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        parallel=ParallelConfig(tensor_parallel_size=size, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S),
        device="cpu",
    )
    return EngineCore(config)


def _generate(engine: EngineCore, rid: str) -> None:
    engine.add_request(EngineCoreRequest(rid, PROMPTS[0], SamplingParams(temperature=0, max_tokens=STEPS)))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(("sig", "said"), [(signal.SIGKILL, "rank 1 died (killed by SIGKILL)"),
                                           (signal.SIGSTOP, "rank 1 is hung")])  # fmt: skip
def test_a_rank_that_dies_or_hangs_is_reported_by_name_within_a_bound(sig, said):
    engine = _engine(2)
    try:
        _generate(engine, "before")
        pid = engine.ranks.procs.pids[1]
        os.kill(pid, sig)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=re.escape(said)):
            while time.monotonic() - t0 < REPORT_BOUND_S * 2:
                _generate(engine, f"after-{time.monotonic()}")
                time.sleep(0.1)
        assert time.monotonic() - t0 < REPORT_BOUND_S
    finally:
        engine.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped


TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 32 << 20, "block_size": 16}}  # fmt: skip
LONG_PROMPTS = [[(7 * i + 3 * j) % 1000 + 3 for j in range(90)] for i in range(3)]


def test_a_sleep_that_keeps_the_tier_resumes_from_it_on_every_rank(tmp_path):
    tier = {**TIER, "kv_connector_extra_config": {**TIER["kv_connector_extra_config"], "disk_path": str(tmp_path),
                                            "disk_bytes_to_use": 64 << 20}}
    reference = greedy(LLM(f"random:{SHAPE}", dtype="float32", kv_cache_bytes=KV_BYTES), LONG_PROMPTS)
    llm = LLM(f"random:{SHAPE}", dtype="float32", kv_cache_bytes=KV_BYTES, tensor_parallel_size=2,
              kv_transfer_config=tier)  # fmt: skip
    try:
        assert greedy(llm, LONG_PROMPTS) == reference
        llm.sleep(level=1, clear_connector_cache=False)  # the device cache goes; the tier stays
        llm.wake_up()
        before = llm.get_metrics()
        # Each rank's KV of the prompts comes from its own part of the tier: a rank whose
        # part were missing or stale would break the all-reduced activations of every layer.
        assert greedy(llm, LONG_PROMPTS) == reference
        after = llm.get_metrics()
        hits = after["siesta_external_prefix_cache_hits_total"] - before.get("siesta_external_prefix_cache_hits_total", 0)
        full_blocks = sum((len(p) - 1) // 16 for p in LONG_PROMPTS)
        assert hits == full_blocks * 16
        kv = llm.engine.runner.kv_cache
        key = 'siesta_kv_offload_load_bytes_total{tier="host"}'
        loaded = after[key] - before.get(key, 0)
        assert loaded == full_blocks * kv.block_bytes * 2  # both ranks' shards
    finally:
        llm.engine.close()


# -- SGLang's one-call updates reach every rank ------------------------------------------------


def test_sglang_tensors_one_entry_per_rank_reach_every_rank(tp2):
    import torch.multiprocessing as mp
    from weight_transfer.sglang_trainer import serialize

    hf = trainer_model(seed=21)
    named = [(n, t.detach().contiguous()) for n, t in hf.state_dict().items()]
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # shared memory by name: any process may open it
    try:
        entries = [serialize(named), serialize(named)]
        result = tp2.engine.update_weights_from_tensor(entries, weight_version="sglang-tensors")
    finally:
        mp.set_sharing_strategy(before)
    assert result.weight_version == "sglang-tensors"
    assert_matches(tp2, hf)


def test_sglang_group_every_rank_joins_and_receives(tp2):
    import threading

    from weight_transfer.sglang_trainer import broadcast_each, init_group_like_sglang

    from siesta.weight_transfer.sender import free_port

    port, name = free_port(), "slime-pp_0"
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": name, "backend": "gloo"}  # fmt: skip
    joined: list = []
    t = threading.Thread(target=lambda: joined.append(tp2.engine.init_weights_update_group(init)))
    t.start()
    group = init_group_like_sglang("127.0.0.1", port, 3, name, "gloo", 60.0)
    t.join(60)
    assert joined == [name]
    hf = trainer_model(seed=22)
    named = [(n, t.detach().contiguous()) for n, t in hf.state_dict().items()]
    done: list = []
    call = threading.Thread(target=lambda: done.append(tp2.engine.update_weights_from_distributed(
        [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named], group_name=name)))  # fmt: skip
    call.start()
    broadcast_each(group, [t for _, t in named])
    call.join(60)
    assert done and done[0].weight_version
    assert_matches(tp2, hf)
    tp2.engine.destroy_weights_update_group(name)


def test_a_checkpoint_from_disk_is_read_by_every_rank(tp2, tmp_path):
    hf = trainer_model(seed=23)
    hf.save_pretrained(tmp_path / "ckpt")
    result = tp2.engine.update_weights_from_disk(str(tmp_path / "ckpt"), weight_version="disk")
    assert result.weight_version == "disk"
    assert_matches(tp2, hf)


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-qwen3"])
def test_qwen_models_at_tensor_parallel_2_generate_what_1_and_transformers_do(shape):
    """Qwen2's q/k/v biases (added once per shard) and Qwen3's per-head q/k norms, through the engine."""
    single = greedy(LLM(f"random:{shape}", dtype="float32", kv_cache_bytes=KV_BYTES))
    llm = LLM(f"random:{shape}", dtype="float32", kv_cache_bytes=KV_BYTES, tensor_parallel_size=2)
    try:
        assert greedy(llm) == single
    finally:
        llm.engine.close()
    hf = hf_twin(resolve_model(f"random:{shape}"))
    assert [hf_greedy_ids(hf, p, STEPS) for p in PROMPTS] == single


def test_a_script_without_a_main_guard_is_told_so_before_the_start_timeout(tmp_path):
    """Spawned ranks import the main module: an unguarded script makes its LLM again in rank 1,
    which refuses at once and says why; rank 0 reports it long before the 120 s group timeout."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text('from siesta import LLM\nLLM("random:tiny-llama", tensor_parallel_size=2, kv_cache_bytes=1 << 22)\n')
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "rank 1 died" in last and 'if __name__ == "__main__":' in last
    assert time.monotonic() - t0 < 100
