"""Tensor parallelism on the CPU: real processes over gloo, each building its rank's model
(``TensorParallel``) from the same full weights, together compute the whole model's logits.

The oracles: the tensor parallel 1 model and transformers on the same weights, over a paged
prefill of two requests and teacher-forced decode steps (``tp_ranks.run_steps``). The weight
updater at tensor parallel 2 takes full tensors (by name, fused and unfused) and each rank keeps
the slice that the hand-computed ranges below say; a full shape it does not expect is refused
before anything is written.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
import tp_ranks
from threads import single_thread
from tp_ranks import BROADCAST_SEED, CASES, EMBEDDED, FUSED_SEED, TRAINER_SEED, UPDATE_CASE, Job

from siesta.attention.torch_ref import TorchAttention
from siesta.model.layers import Embedding, Linear
from siesta.model.llama import CausalLM
from siesta.model.parallel import SINGLE, TensorParallel
from siesta.weight_transfer.sender import free_port

LOGIT_TOLERANCE = 1e-4  # fp32; the ranks' partial sums add up in another order
# The embedded model has 30 layers of 576-wide sums (the tiny ones 2 of 64), and its CPU linears
# go through oneDNN, whose fp32 sums are within the dot-product bound but not MKL's bits: the
# reordering error grows with depth and width (3.3e-4 measured against 1e-4 on the tiny models).
DEEP_LOGIT_TOLERANCE = 1e-3
TP4_CASES = ("llama-gqa", "qwen3-qk-norm")  # KV heads (2) fewer than ranks: replicated
SHM_DIR = Path("/dev/shm")


@pytest.fixture(scope="module")
def trainer_shm():
    """The trainer's full tensors (its own seed) in a shared-memory file, declared for an ipc push."""
    path = SHM_DIR / f"siesta-tp-test-{uuid.uuid4().hex}"
    weights = tp_ranks.random_weights(tp_ranks.case_config(UPDATE_CASE), TRAINER_SEED)
    info = tp_ranks.write_shm_weights(str(path), weights)
    yield info, weights
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, trainer_shm):
    """One world of four processes for every group: two ranks over every case and the weight
    updates (the last process broadcasting as the trainer), four over the replicated-KV cases,
    three over the embedded model."""
    tmp = tmp_path_factory.mktemp("tp")
    info_path = tmp / "shm_info.json"
    info_path.write_text(json.dumps({"shm": trainer_shm[0], "master_port": free_port()}))
    jobs = [Job(2, tuple(CASES), updates=str(info_path)), Job(4, TP4_CASES), Job(3, (EMBEDDED,))]
    tp_ranks.spawn(4, tmp, jobs)
    return tmp


def _reference(case: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensor parallel 1 model's logits and transformers'."""
    config, weights = tp_ranks.case_weights(case)
    with single_thread():
        single = tp_ranks.run_steps(tp_ranks.build(config, weights))
        return single, tp_ranks.hf_steps(tp_ranks.hf_model(config, weights))


def _assert_logits_match(got: list[torch.Tensor], case: str) -> None:
    single, hf = _reference(case)
    tol = DEEP_LOGIT_TOLERANCE if case == "embedded" else LOGIT_TOLERANCE
    assert len(got) == len(single) == len(hf)
    for step, (g, s, h) in enumerate(zip(got, single, hf)):
        assert g.shape == s.shape == h.shape, (case, step)
        torch.testing.assert_close(
            g, s, rtol=0, atol=tol, msg=lambda m, step=step: f"{case} step {step} vs tp1: {m}"
        )
        torch.testing.assert_close(
            g, h, rtol=0, atol=tol, msg=lambda m, step=step: f"{case} step {step} vs hf: {m}"
        )
        assert torch.equal(g.argmax(-1), h.argmax(-1)), (case, step)


def _load(ranks: Path, size: int, what: str):
    return torch.load(ranks / f"tp{size}.{what}.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_compute_the_whole_models_logits(ranks, case):
    _assert_logits_match(_load(ranks, 2, f"{case}.logits"), case)


@pytest.mark.parametrize("case", TP4_CASES)
def test_four_ranks_with_replicated_kv_heads_compute_the_whole_models_logits(ranks, case):
    _assert_logits_match(_load(ranks, 4, f"{case}.logits"), case)


def test_embedded_gguf_model_over_three_ranks_of_a_subgroup(ranks):
    """SmolLM2 has 9 query heads and 3 KV heads: three ranks of three and one, in a group
    of the world's first three processes."""
    _assert_logits_match(_load(ranks, 3, f"{EMBEDDED}.logits"), EMBEDDED)
    assert [_load(ranks, 3, f"{EMBEDDED}.local.{r}")["kv_head_start"] for r in range(3)] == [0, 1, 2]


def test_kv_heads_are_split_or_replicated_by_the_query_heads_that_read_them(ranks):
    """Each rank's KV cache holds the heads its query heads use: with fewer KV heads than
    ranks, consecutive ranks share one (rank r of 4 over 2 KV heads holds head r // 2)."""
    local = {(size, r): _load(ranks, size, f"llama-gqa.local.{r}") for size in (2, 4) for r in range(size)}
    assert [(local[2, r]["num_kv_heads"], local[2, r]["kv_head_start"]) for r in range(2)] == [(1, 0), (1, 1)]
    assert [(local[4, r]["num_kv_heads"], local[4, r]["kv_head_start"]) for r in range(4)] == [
        (1, 0),
        (1, 0),
        (1, 1),
        (1, 1),
    ]
    assert [local[4, r]["num_heads"] for r in range(4)] == [1, 1, 1, 1]
    mqa = [_load(ranks, 2, f"llama-mqa-tied-odd-vocab.local.{r}") for r in range(2)]
    assert [(m["num_kv_heads"], m["kv_head_start"]) for m in mqa] == [(1, 0), (1, 0)]
    assert [(m["vocab_start"], m["vocab_size"], m["padded_vocab_size"]) for m in mqa] == [
        (0, 501, 1002),
        (501, 501, 1002),
    ]


def test_the_model_runners_kv_cache_holds_this_ranks_kv_heads(ranks):
    """tiny-llama: 2 layers, 2 KV heads of 16, fp32; at two ranks each holds one KV head, so
    the same bytes hold twice the blocks (every block is half as large)."""
    single = tp_ranks.runner_kv_cache(SINGLE)
    block_bytes = 2 * 2 * tp_ranks.BLOCK_SIZE * 16 * 4  # layers x (K, V) x tokens x head_dim x fp32
    assert single["shape"] == (tp_ranks.RUNNER_KV_BYTES // (2 * block_bytes), 2, 2, tp_ranks.BLOCK_SIZE, 2, 16)
    for rank in range(2):
        got = _load(ranks, 2, f"runner.{rank}")
        assert got["shape"] == (tp_ranks.RUNNER_KV_BYTES // block_bytes, 2, 2, tp_ranks.BLOCK_SIZE, 1, 16)
        assert got["local"]["kv_head_start"] == rank


# -- weight updates at tensor parallel 2 --------------------------------------------------------

# llama-gqa by hand: 4 heads of 16 (2 per rank), 2 KV heads (1 per rank), 128 MLP features (64
# per rank), a vocabulary of 1024 (512 per rank).
HEAD, Q_ROWS, KV_ROWS, MLP_ROWS, VOCAB_ROWS = 16, 32, 16, 64, 512


def _slice_by_hand(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` must hold of the full tensors, cut with the numbers above."""
    q, kv, m, v = (slice(rank * n, (rank + 1) * n) for n in (Q_ROWS, KV_ROWS, MLP_ROWS, VOCAB_ROWS))
    out = {"model.embed_tokens.weight": full["model.embed_tokens.weight"][v],
           "lm_head.weight": full["lm_head.weight"][v], "model.norm.weight": full["model.norm.weight"]}  # fmt: skip
    for layer in range(2):
        a, p = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        out[f"{a}.qkv_proj.weight"] = torch.cat(
            [full[f"{a}.q_proj.weight"][q], full[f"{a}.k_proj.weight"][kv], full[f"{a}.v_proj.weight"][kv]]
        )
        out[f"{a}.o_proj.weight"] = full[f"{a}.o_proj.weight"][:, q]
        out[f"{p}.gate_up_proj.weight"] = torch.cat([full[f"{p}.gate_proj.weight"][m], full[f"{p}.up_proj.weight"][m]])
        out[f"{p}.down_proj.weight"] = full[f"{p}.down_proj.weight"][:, m]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{layer}.{norm}.weight"] = full[f"model.layers.{layer}.{norm}.weight"]
    return out


def _updates(ranks: Path) -> list[dict]:
    return [_load(ranks, 2, f"updates.{r}") for r in range(2)]


def test_a_shard_shaped_declaration_is_refused_before_writing(ranks):
    for result in _updates(ranks):
        assert "q_proj.weight" in result["shard_shape_refusal"] and "[64, 64]" in result["shard_shape_refusal"]
        assert "q_proj.weight" in result["mapping_refusal"]
        assert result["unchanged_after_refusals"]


def test_full_tensors_pushed_by_name_land_as_each_ranks_slice(ranks, trainer_shm):
    full = trainer_shm[1]
    for rank, result in enumerate(_updates(ranks)):
        state = result["state_after_push"]
        for name, want in _slice_by_hand(full, rank).items():
            assert torch.equal(state[name], want), (rank, name)
    # Together the slices are the trainer's model: rank 0's logits are transformers' on its weights.
    config = tp_ranks.case_config(UPDATE_CASE)
    hf = tp_ranks.hf_steps(tp_ranks.hf_model(config, full))[0]
    torch.testing.assert_close(_updates(ranks)[0]["logits_after_push"], hf, rtol=0, atol=LOGIT_TOLERANCE)


def test_full_tensors_broadcast_in_a_trainer_group_land_as_each_ranks_slice(ranks):
    full = tp_ranks.random_weights(tp_ranks.case_config(UPDATE_CASE), BROADCAST_SEED)
    for rank, result in enumerate(_updates(ranks)):
        state = result["state_after_broadcast"]
        for name, want in _slice_by_hand(full, rank).items():
            assert torch.equal(state[name], want), (rank, name)


def test_fused_tensors_pushed_whole_land_as_each_ranks_q_k_v_and_gate_up_rows(ranks):
    fused = tp_ranks.fused_update(FUSED_SEED)
    unfused = tp_ranks.random_weights(tp_ranks.case_config(UPDATE_CASE), FUSED_SEED)
    for rank, result in enumerate(_updates(ranks)):
        want = _slice_by_hand(unfused, rank)
        state = result["state_after_fused"]
        for name in fused:
            assert torch.equal(state[name], want[name]), (rank, name)
        # Everything else kept the previous push's values.
        assert torch.equal(state["model.layers.0.self_attn.qkv_proj.weight"],
                           result["state_after_push"]["model.layers.0.self_attn.qkv_proj.weight"])  # fmt: skip
        attn, mlp = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
        assert result["fused_written"] == sorted([f"{mlp}:gate", f"{mlp}:up", f"{attn}:q", f"{attn}:k", f"{attn}:v"])


# -- in process: the rules, and size 1 exactly as before ----------------------------------------


def test_size_one_builds_todays_layers_without_collectives():
    with torch.device("meta"):
        model = CausalLM(tp_ranks.case_config("llama-gqa"), tp_ranks.MAX_POSITIONS, TorchAttention())
    assert model.tp is SINGLE
    assert type(model.model.embed_tokens) is Embedding and type(model.lm_head) is Linear
    layer = model.model.layers[0]
    assert type(layer.self_attn.o_proj) is Linear and type(layer.mlp.down_proj) is Linear
    assert model.local.num_kv_heads == model.shape.num_kv_heads == 2


def test_a_model_that_does_not_split_names_what_does_not_divide():
    config = tp_ranks.case_config("llama-gqa")  # 4 heads, 2 KV heads
    with torch.device("meta"), pytest.raises(ValueError, match="attention heads"):
        CausalLM(config, tp_ranks.MAX_POSITIONS, TorchAttention(), TensorParallel(rank=0, size=3))
    with pytest.raises(ValueError, match="vocabulary"):
        TensorParallel(rank=1, size=2).shard(1001, "vocabulary rows")
    with pytest.raises(ValueError, match="outside"):
        TensorParallel(rank=2, size=2)
