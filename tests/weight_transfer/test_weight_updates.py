"""Weight transfer into an offline engine, against transformers on the trainer's weights.

The trainer is a transformers model (its own random init, so every tensor changes); the
engine a tiny random model of the same architecture. After a push the engine's logprobs
equal transformers' on the trainer's weights (fp32). Bad input is refused with nothing
written; a trainer that dies or goes silent mid-transfer leaves the engine refusing to
generate, at the same version, until a complete update arrives.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from siesta import LLM, SamplingParams
from siesta.control import EngineStateError, RequestRejected
from siesta.model.random_init import RANDOM_SHAPES
from siesta.weight_transfer import WeightSender, WeightTransferError, updater
from siesta.weight_transfer.sender import free_port
from siesta.weight_transfer.updater import UpdateFailed

PROMPT = [3, 17, 42, 7, 99, 5, 250, 11, 64, 8, 1, 300, 77, 21, 9, 4, 123, 56, 31, 2]
STEPS = 6
TOLERANCE = 1e-4  # fp32 on both sides
KV_BYTES = 16 << 20
TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20}}  # fmt: skip
HANG_TIMEOUT_S = 2.0
BUCKET_BYTES = 64 << 10  # a tiny model (820 kB in fp32) in several buckets
TRAINERS = Path(__file__).with_name("trainers.py")


def trainer_model(shape: str = "tiny-llama", seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(RANDOM_SHAPES[shape].config()).float().eval()


def engine(backend: str = "nccl", shape: str = "tiny-llama", **kw) -> LLM:
    base = {"dtype": "float32", "kv_cache_bytes": KV_BYTES, "weight_transfer_config": {"backend": backend}}
    return LLM(f"random:{shape}", **(base | kw))


def engine_logprobs(llm: LLM, prompt=PROMPT, steps: int = STEPS) -> tuple[list[int], list[float]]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def hf_logprobs(hf: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def assert_matches(llm: LLM, hf: torch.nn.Module) -> None:
    tokens, got = engine_logprobs(llm)
    with torch.no_grad():
        first = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    assert tokens[0] == int(first.argmax())
    want = hf_logprobs(hf, PROMPT, tokens)
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOLERANCE


def snapshot(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}


def unchanged(llm: LLM, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in llm.engine.runner.model.named_parameters())


# -- pushes land, against transformers -------------------------------------------------------


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
@pytest.mark.parametrize("packed", [True, False])
def test_a_push_makes_the_engine_the_trainers_model(backend, packed):
    llm, hf = engine(backend), trainer_model()
    sender = WeightSender(llm, backend, packed=packed, bucket_bytes=BUCKET_BYTES)
    sender.init()
    try:
        assert sender.push(hf) == "1"
        assert_matches(llm, hf)
        hf2 = trainer_model(seed=2)
        assert sender.push(hf2, weight_version="step-2") == "step-2"  # the group and handles are reused
        assert_matches(llm, hf2)
        assert llm.get_weight_version() == "step-2"
    finally:
        sender.close()
    stats = llm.get_metrics()
    assert stats[f'siesta_weight_transfer_bytes_total{{backend="{backend}"}}'] >= 2 * sum(
        p.numel() * 4 for p in hf.parameters()
    )


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-qwen3"])
def test_biases_qk_norms_and_fused_names_land(shape):
    llm, hf = engine("ipc", shape), trainer_model(shape)
    sender = WeightSender(llm, "ipc", fuse=True)
    sender.init()
    sender.push(hf)
    sender.close()
    assert_matches(llm, hf)


@pytest.mark.parametrize("foreach_max_bytes", [updater.FOREACH_MAX_BYTES, 1024])
def test_fp32_masters_are_cast_into_bf16_weights_on_the_engine(monkeypatch, foreach_max_bytes):
    # The default copies every tiny tensor in multi-tensor launches; 1 kB splits them: the norms
    # (128 B in bf16) go that way, the linears and embeddings one copy each.
    monkeypatch.setattr(updater, "FOREACH_MAX_BYTES", foreach_max_bytes)
    llm, hf = engine("nccl", dtype="bfloat16"), trainer_model()
    sender = WeightSender(llm, "nccl")
    sender.init()
    sender.push(hf)
    sender.close()
    model = llm.engine.runner.model
    for name, tensor in hf.state_dict().items():
        target = model.weight_target(name)
        if target is not None:
            assert target.view.dtype == torch.bfloat16 and torch.equal(target.view, tensor.to(torch.bfloat16)), name


# -- bad input: refused by name, nothing written, the engine serves on ----------------------


def _refused(llm: LLM, call, needle: str) -> None:
    before, version = snapshot(llm), llm.get_weight_version()
    with pytest.raises((WeightTransferError, ValueError)) as err:
        call()
    assert needle in str(err.value)
    assert unchanged(llm, before) and llm.get_weight_version() == version
    assert engine_logprobs(llm)[0]  # still serving: the refused call left no update open


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_an_unknown_name_or_a_wrong_shape_writes_nothing(backend):
    llm, hf = engine(backend), trainer_model()
    sender = WeightSender(llm, backend)
    sender.init()
    bad_name = dict(hf.state_dict()) | {"model.layers.0.mlp.extra_proj.weight": torch.zeros(3, 3)}
    _refused(llm, lambda: sender.send(bad_name), "'model.layers.0.mlp.extra_proj.weight' has no place")
    bad_shape = dict(hf.state_dict()) | {"model.norm.weight": torch.ones(7)}
    _refused(llm, lambda: sender.send(bad_shape), "model.norm.weight: update_info declares shape [7]")
    # The nccl group is still in step: a good push goes through.
    sender.push(hf)
    sender.close()
    assert_matches(llm, hf)


def test_a_weight_of_an_integer_dtype_is_refused():
    llm = engine("ipc")
    llm.init_weight_transfer_engine({"init_info": {}})
    info = {"names": ["model.norm.weight"], "dtype_names": ["int64"], "shapes": [[64]], "ipc_handles": [{}]}
    _refused(llm, lambda: llm.update_weights({"update_info": info}), "dtype 'int64' cannot be a weight")


def test_a_bucket_whose_sizes_do_not_add_up_is_refused(tmp_path):
    llm = engine("ipc")
    llm.init_weight_transfer_engine({"init_info": {}})
    norm = llm.engine.runner.model.weight_target("model.norm.weight").view
    path = f"/dev/shm/siesta-test-bucket-{id(tmp_path):x}"
    torch.from_file(path, shared=True, size=norm.numel() * 2, dtype=torch.uint8)  # half what is declared
    base = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [list(norm.shape)], "packed": True}
    try:
        handle = {"shm": path, "offset": 0, "nbytes": norm.numel() * 2}
        _refused(llm, lambda: llm.update_weights({"update_info": base | {"ipc_handles": handle}}),
                 "the bucket's sizes do not add up")  # fmt: skip
        _refused(llm, lambda: llm.update_weights({"update_info": base | {"ipc_handles": handle,
                                                                        "tensor_sizes": [norm.numel()]}}),
                 "the bucket's sizes do not add up")  # fmt: skip
    finally:
        Path(path).unlink()


def test_an_update_before_init_is_refused():
    llm = engine("nccl")
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
    _refused(llm, lambda: llm.update_weights({"update_info": info}), "call init_weight_transfer_engine first")


# -- a trainer that dies or hangs mid-transfer -------------------------------------------------


def _misbehaving_trainer(llm: LLM, mode: str, nbytes: int = 0) -> subprocess.Popen:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(TRAINERS), "--port", str(port), "--mode", mode, "--nbytes", str(nbytes)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "starting"
    llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                   "rank_offset": 1, "world_size": 2}})  # fmt: skip
    assert proc.stdout.readline().strip() == "joined"
    return proc


def _full_update_info(hf: torch.nn.Module, bucket_bytes: int) -> tuple[dict, int]:
    state = hf.state_dict()
    info = {"names": list(state), "dtype_names": ["float32"] * len(state), "shapes": [list(t.shape) for t in state.values()],
            "packed": True, "packed_buffer_size_bytes": bucket_bytes}  # fmt: skip
    first_bucket = 0
    for t in state.values():
        first_bucket += t.numel() * 4
        if first_bucket > bucket_bytes:
            break
    return info, first_bucket


@pytest.mark.parametrize("mode", ["die-after", "hang-after"])
def test_a_trainer_that_dies_or_hangs_mid_transfer_leaves_no_half_new_weights_in_use(mode):
    llm = engine(
        "nccl", kv_transfer_config=TIER, weight_transfer_config={"backend": "nccl", "timeout_s": HANG_TIMEOUT_S}
    )
    hf = trainer_model()
    engine_logprobs(llm)  # some KV in the tier, under version 0
    stores = llm.get_metrics()['siesta_kv_offload_store_bytes_total{tier="host"}']
    info, first_bucket = _full_update_info(hf, bucket_bytes=BUCKET_BYTES)
    proc = _misbehaving_trainer(llm, mode, first_bucket)  # sends the first bucket only
    t0 = time.monotonic()
    llm.start_weight_update()
    with pytest.raises(UpdateFailed) as err:
        llm.update_weights({"update_info": info})
    elapsed = time.monotonic() - t0
    proc.kill()
    proc.wait()
    assert elapsed < HANG_TIMEOUT_S + 10  # bounded: never a hang
    assert "the weight broadcast failed" in str(err.value) and "are not written" in str(err.value)
    assert llm.get_weight_version() == "0"
    # The engine refuses to generate from part-new weights, with the reason, and cannot finish.
    with pytest.raises(RequestRejected, match="cannot generate: a weight transfer broke off"):
        engine_logprobs(llm)
    with pytest.raises(EngineStateError, match="cannot finish"):
        llm.finish_weight_update()
    assert llm.get_metrics()['siesta_kv_offload_store_bytes_total{tier="host"}'] == stores
    assert llm.get_metrics()['siesta_weight_transfer_failures_total{backend="nccl"}'] == 1
    # A complete update from a trainer that joins again makes the engine whole.
    sender = WeightSender(llm, "nccl")
    sender.init()
    assert sender.push(hf) == "1"
    sender.close()
    assert_matches(llm, hf)


def test_a_trainer_that_dies_before_its_first_byte_leaves_the_weights_as_they_were():
    llm = engine("nccl", weight_transfer_config={"backend": "nccl", "timeout_s": HANG_TIMEOUT_S})
    info, _ = _full_update_info(trainer_model(), bucket_bytes=BUCKET_BYTES)
    before = snapshot(llm)
    proc = _misbehaving_trainer(llm, "die-after", 0)
    with pytest.raises(UpdateFailed, match="nothing was written, the weights are unchanged"):
        llm.update_weights({"update_info": info})
    proc.wait()
    assert unchanged(llm, before) and llm.get_weight_version() == "0"
    assert engine_logprobs(llm)[0]  # serving, and no update left open


# -- the RL flows ---------------------------------------------------------------------------


def test_colocated_flow_sleep_level_2_then_weights_then_kv_cache():
    llm, hf = engine("ipc", kv_transfer_config=TIER), trainer_model()
    sender = WeightSender(llm, "ipc")
    sender.init()
    engine_logprobs(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert sender.push(hf) == "1"
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert_matches(llm, hf)
    sender.close()


@pytest.mark.parametrize("level", [1, 2])
def test_a_push_after_a_sleep_lands_in_the_woken_weights(level):
    # The model keeps each name's bound views between pushes; a CPU sleep resizes the storages
    # to nothing and back (new addresses), so the second push must write the woken storage.
    llm, hf1, hf2 = engine("ipc"), trainer_model(seed=1), trainer_model(seed=2)
    sender = WeightSender(llm, "ipc")
    sender.init()
    assert sender.push(hf1) == "1"
    assert_matches(llm, hf1)
    llm.sleep(level=level)
    llm.wake_up(tags=["weights"])
    assert sender.push(hf2) == "2"
    llm.wake_up(tags=["kv_cache"])
    assert_matches(llm, hf2)
    sender.close()


def test_after_a_level_2_sleep_a_partial_update_cannot_finish():
    llm, hf = engine("ipc"), trainer_model()
    sender = WeightSender(llm, "ipc")
    sender.init()
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.start_weight_update()
    sender.send({"model.norm.weight": hf.state_dict()["model.norm.weight"]})
    with pytest.raises(EngineStateError, match="a level-2 sleep released the weights: .* are not written"):
        llm.finish_weight_update()
    sender.send(hf)  # the rest
    assert llm.finish_weight_update() == "1"
    llm.wake_up(tags=["kv_cache"])
    assert_matches(llm, hf)
    sender.close()


def test_nothing_steps_while_an_update_is_open():
    llm, hf = engine("ipc"), trainer_model()
    sender = WeightSender(llm, "ipc")
    sender.init()
    rid = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.start_weight_update()
    for _ in range(3):
        assert not llm.step()  # held: no token from half-new weights
    sender.send(hf)
    llm.finish_weight_update()
    outs = []
    while llm.has_unfinished_requests():
        outs = [o for o in llm.step() if o.request_id == rid] or outs
    tokens = outs[-1].outputs[0].token_ids
    assert outs[-1].outputs[0].weight_versions[0].weight_version == "1"
    assert tokens == engine_logprobs(llm, steps=4)[0]  # the new weights' greedy tokens
    sender.close()


def _run_until(llm: LLM, rid: str, tokens: int):
    out = None
    while out is None or len(out.outputs[0].token_ids) < tokens:
        out = next((o for o in llm.step() if o.request_id == rid), out)
    return out


@pytest.mark.parametrize("clear_cache", [True, False])
def test_keep_mode_update_continues_in_flight_requests_on_the_new_weights(clear_cache):
    """AReaL / prime-rl: pause(keep) -> update -> resume. By default the in-flight KV is
    recomputed under the new version; with clear_cache=False it is kept, and no block built
    on it is ever served to a fresh request of the new version."""
    llm, hf = engine("ipc", max_num_seqs=4), trainer_model()
    sender = WeightSender(llm, "ipc")
    sender.init()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = PROMPT * 2  # 40 tokens: full blocks before and after the update
    rid = llm.add_request(prompt, params)
    before = _run_until(llm, rid, 10).outputs[0].token_ids
    preempted = llm.get_metrics()["siesta_num_preemptions_total"]
    llm.pause(mode="keep", clear_cache=clear_cache)
    sender.push(hf)
    llm.resume()
    out = None
    while llm.has_unfinished_requests():
        out = next((o for o in llm.step() if o.request_id == rid), out)
    completion = out.outputs[0]
    n_old = len(before)
    assert completion.token_ids[:n_old] == before
    spans = [(s.weight_version, s.start, s.end) for s in completion.weight_versions]
    assert spans == [("0", 0, n_old), ("1", n_old, 40)]
    recomputed = llm.get_metrics()["siesta_num_preemptions_total"] > preempted
    assert recomputed == clear_cache
    if clear_cache:  # recomputed under the new weights: the rest is the new model's greedy continuation
        ids = torch.tensor([prompt + completion.token_ids[:n_old]])
        with torch.no_grad():
            assert completion.token_ids[n_old] == int(hf(ids).logits[0, -1].argmax())
    # A fresh request of the new version over the same tokens hits nothing built on old KV.
    hits = llm.get_metrics()["siesta_prefix_cache_hits_total"]
    fresh = llm.generate([prompt + completion.token_ids[:30]], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0]  # fmt: skip
    if clear_cache:
        assert fresh.num_cached_tokens > 0  # recomputed blocks are new-version blocks
    else:
        assert fresh.num_cached_tokens == 0
        assert llm.get_metrics()["siesta_prefix_cache_hits_total"] == hits
    sender.close()


def test_finish_evicts_old_version_kv_from_the_tier():
    llm, hf = engine("ipc", kv_transfer_config=TIER), trainer_model()
    engine_logprobs(llm)
    assert llm.get_metrics()['siesta_kv_offload_bytes_used{tier="host"}'] > 0
    sender = WeightSender(llm, "ipc")
    sender.init()
    sender.push(hf)
    sender.close()
    assert llm.get_metrics()['siesta_kv_offload_bytes_used{tier="host"}'] == 0
    hits = llm.get_metrics()["siesta_external_prefix_cache_hits_total"]
    assert_matches(llm, hf)
    assert llm.get_metrics()["siesta_external_prefix_cache_hits_total"] == hits


def test_a_refused_push_leaves_no_update_open():
    """The sender finishes what it started: a refusal must not hold the engine's steps."""
    llm = engine("ipc")
    sender = WeightSender(llm, "ipc")
    sender.init()
    with pytest.raises(WeightTransferError, match="has no place"):
        sender.push({"model.layers.0.mlp.extra_proj.weight": torch.zeros(3, 3)})
    assert not llm.engine.weights.open and llm.get_weight_version() == "0"
    assert engine_logprobs(llm)[0]
    llm.start_weight_update()
    with pytest.raises(EngineStateError, match="a weight update is open: finish_weight_update"):
        engine_logprobs(llm)
    llm.finish_weight_update()
    sender.close()


@pytest.mark.parametrize("wrote", [False, True])
def test_an_update_left_open_by_a_vanished_trainer_expires(wrote):
    llm = engine("ipc", weight_transfer_config={"backend": "ipc", "timeout_s": 0.5})
    sender = WeightSender(llm, "ipc")
    sender.init()
    llm.start_weight_update()
    if wrote:
        sender.send({"model.norm.weight": torch.ones(64)})
    time.sleep(0.6)
    assert not llm.engine.has_work()  # looks, and closes the update
    assert not llm.engine.weights.open
    if wrote:  # part of an update, then silence: the weights are torn until a full push
        with pytest.raises(RequestRejected, match="left open for 0.5s without a call or a finish after writing 1"):
            engine_logprobs(llm)
        sender.push(trainer_model())
    assert engine_logprobs(llm)[0]
    sender.close()
