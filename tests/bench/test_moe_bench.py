"""The GPU bench's ``moe`` section, run on the CPU on the tiny Qwen3-MoE: its roofline arithmetic
against a count by hand, and the section end to end (decode, prefill, the fidelity oracle)."""

from __future__ import annotations

import argparse
import gc
import json
import math
import weakref
from dataclasses import asdict

import pytest

import siesta
from siesta import pdl
from siesta.bench import gpu
from siesta.bench import moe as moe_bench
from siesta.bench.moe import expected_experts_touched
from siesta.bench.moe_tiles import tile_label
from siesta.config import EngineConfig
from siesta.model import triton_moe


def test_experts_touched_is_the_uniform_expectation() -> None:
    assert expected_experts_touched(1, 128, 8) == pytest.approx(8.0)
    # Two tokens: 8 + 8 * (120 / 128) distinct experts on average (the second's picks that miss the first's).
    assert expected_experts_touched(2, 128, 8) == pytest.approx(8 + 8 * 120 / 128)
    assert expected_experts_touched(10_000, 128, 8) == pytest.approx(128.0)


def test_the_section_runs_on_the_tiny_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    engines: list[weakref.ref] = []

    class Recorded(siesta.LLM):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            engines.append(weakref.ref(self))

    monkeypatch.setattr(siesta, "LLM", Recorded)
    alive_at_fidelity: list[int] = []

    def fidelity(*a, **kw):
        gc.collect()
        alive_at_fidelity.append(sum(ref() is not None for ref in engines))
        return oracle(*a, **kw)

    oracle = moe_bench.fidelity
    monkeypatch.setattr(moe_bench, "fidelity", fidelity)
    args = gpu.build_parser().parse_args([])
    small = {"moe_model": "random:tiny-qwen3-moe", "moe_check_shape": "tiny-qwen3-moe", "moe_check_layers": 2,
             "moe_check_tokens": 160, "moe_prefill_tokens": 128, "moe_parts": ["sorted_small_batches", "library_prefill", "fidelity", "pdl"],
             "decode_batches": [1, 4], "moe_prefill_tiles": "128x128x64w8s4d",
             "decode_context": 32, "decode_steps": 2, "max_model_len": 512, "device": "cpu"}  # fmt: skip
    shipped = triton_moe.LARGE_PREFILL_TILES
    out = gpu.SECTIONS["moe"](argparse.Namespace(**(vars(args) | small)))
    json.dumps(out)
    # The shared engine is gone before the parts that make their own: on an H100 a partial that
    # outlived ``del llm`` kept its 66 GiB, and the parts after it ran out of memory.
    assert alive_at_fidelity == [0]
    assert out["decode"]["batch1"]["experts_touched_per_layer"] == pytest.approx(2.0)
    assert 0 < out["decode"]["batch4"]["of_roofline"] and out["prefill"]["tok_s"] > 0
    # bf16 on the CPU against transformers fp32, in units of transformers' own bf16 floor.
    assert out["fidelity"]["push_batch1"]["worst_ratio"] is not None
    # Its routing against transformers' router: every (position, sparse layer) counted once.
    route = out["fidelity"]["push_batch1"]["routing"]
    assert route["decisions"] == (160 + 16 - 1) * 2  # the check's prompt and decoded tokens, 2 sparse layers
    assert 0 <= route["engine_beyond_floor"] <= route["engine_differs"] <= route["decisions"]
    assert out["kernels_batch1"]["launches"] > 0 and out["kernels_batch1"]["top_kernels_ms_per_step"]
    # The A/B engine (experts always sorted) ran batch 1 only: the batches the pair kernels serve.
    assert {k for k in out["sorted_small_batches"] if k.startswith("batch")} == {"batch1"}
    assert out["sorted_small_batches"]["batch1"]["pair_kernels_speedup"] > 0
    # The prefill again with the library's grouped GEMM switched on (the CPU's experts are torch's
    # either way, so here only that the A/B runs and reads).
    assert out["library_prefill"]["tok_s"] > 0 and out["library_prefill"]["speedup_over_fused"] > 0
    # The prefill again on other large-prefill tiles (the CPU's experts are torch's: only that it
    # runs, reads, and leaves the shipped tiles in force).
    tiles = out["prefill_tiles"]
    assert tiles["128x128x64w8s4d"]["tok_s"] > 0 and tiles["shipped"] == tile_label(asdict(shipped))
    assert triton_moe.LARGE_PREFILL_TILES is shipped
    # Every timed prompt was prefilled whole: none hit the prefix cache an earlier run left (on
    # an H100 the A/B's first prompt did, and its 16-token step was all it timed).
    assert out["prefill"]["prefix_cache_hit_tokens"] == 0
    assert tiles["128x128x64w8s4d"]["prefix_cache_hit_tokens"] == 0
    # Decode with PDL off and on, alternated on the same engine (the CPU has no PDL: only that the
    # A/B runs both arms each round and leaves the engine's own setting in force).
    ab = out["pdl"]
    assert ab["supported"] is False and pdl.enabled() == EngineConfig().programmatic_dependent_launch
    for key in ("batch1", "batch4"):
        assert [len(ab[key]["step_ms"][arm]) for arm in ("off", "on")] == [moe_bench.PDL_AB_ROUNDS] * 2
        assert ab[key]["off_over_on"] > 0
    rows = [r[0] for r in gpu.summary({"moe": out})]
    assert "MoE prefill, tiles 128x128x64w8s4d / shipped" in rows
    assert "MoE decode batch1: step without PDL / with" in rows
    assert "MoE prefill 128: grouped_mm / fused" in rows
    assert "MoE decode batch1 tok/s" in rows and "MoE logprobs / trainer's bf16 floor" in rows
    assert "MoE routing decisions beyond the floor" in rows
    assert "MoE decode batch1: pair kernels / sorted" in rows
    assert "MoE decode batch1 kernel launches a step" in rows
    # The prefill profiled once more: where its time goes.
    assert out["prefill"]["kernels"]["launches"] > 0 and out["prefill"]["kernels"]["top_kernels_ms"]
    assert "MoE prefill 128: device busy ms" in rows
    # ... and where its host time goes: on the CPU every op is host time, so the ops show.
    host = out["prefill"]["host"]
    assert host["wall_ms"] > 0 and host["top_ops_self_ms"] and "MoE prefill 128: host wall ms" in rows


def test_a_skipped_batch_reads_as_skipped_in_the_table() -> None:
    res = {"decode": {"batch256": {"skipped": "the KV cache holds 100 tokens; ..."}}}
    assert gpu.summary({"moe": res}) == [["MoE decode batch256 tok/s", "-", "skipped: the KV cache holds 100 tokens; ..."]]


def test_a_push_that_cannot_fit_twice_is_of_the_layers_that_do(monkeypatch):
    """The 30B shape's push holds its 61 GB twice: on an 80 GB card the trainer pushes the shape
    cut to the layers that fit, every layer's tensors the whole model's, and says so."""
    import types

    import torch

    from siesta.bench import weight_transfer
    from siesta.model.loader import resolve_model
    from siesta.model.random_init import parameter_layout

    whole = resolve_model("random:qwen3-30b-a3b").hf_config
    per_layer, rest = moe_bench.layer_bytes(whole)
    # Counted bytes: the whole shape's tensors are its layers' and the rest's.
    assert sum(math.prod(s) * 2 for _, s in parameter_layout(whole)) == rest + whole.num_hidden_layers * per_layer
    assert 60e9 < rest + whole.num_hidden_layers * per_layer < 62e9
    pushed = {}

    def fake_push(args):
        source = resolve_model(args.model)
        pushed.update(layers=source.hf_config.num_hidden_layers, names=[n for n, _ in parameter_layout(source.hf_config)])
        return {"bytes": 1, "ipc": {"GB_s": 900.0, "of_plain_copy": 0.45}, "plain_copy": {"GB_s": 2000.0}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(weight_transfer, "weight_transfer", fake_push)
    out = moe_bench._push(gpu.build_parser().parse_args([]))
    fit = out["cut"]["layers"]
    assert out["cut"]["of_layers"] == 48 and fit == pushed["layers"]
    # The most layers that fit twice beside the headroom, and not one more.
    assert 2 * (rest + fit * per_layer) + moe_bench.PUSH_HEADROOM_BYTES <= 80e9
    assert 2 * (rest + (fit + 1) * per_layer) + moe_bench.PUSH_HEADROOM_BYTES > 80e9
    layer_names = {n.replace(".layers.0.", ".layers.{}.") for n in pushed["names"] if ".layers.0." in n}
    assert len(pushed["names"]) == len(layer_names) * fit + (len(parameter_layout(whole)) - 48 * len(layer_names))
    assert moe_bench.summary_rows({"weight_transfer": out})[-1][2].endswith(f"({fit} of 48 layers)")


def test_a_push_that_fits_is_of_the_whole_model(tmp_path):
    assert moe_bench.push_model("random:tiny-qwen3-moe", int(80e9), str(tmp_path)) == ("random:tiny-qwen3-moe", None)


def test_the_push_row_reads_the_ipc_rate_against_a_device_copy():
    push = {"bytes": 61e9, "ipc": {"GB_s": 900.0, "of_plain_copy": 0.45}, "plain_copy": {"GB_s": 2000.0}}
    assert moe_bench.summary_rows({"weight_transfer": push}) == [
        ["MoE IPC push / device copy", 0.45, "goal >= 0.3; 900 against 2000 GB/s, 61 GB"]]  # fmt: skip
