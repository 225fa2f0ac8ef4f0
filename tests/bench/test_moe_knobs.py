"""The ``knobs`` part of the GPU bench's ``moe`` section, on the CPU's tiny Qwen3-MoE: every arm
timed at every batch against the base, the sweep's winners among its candidates, and the modules
(and the engine's decode graphs) left as they were."""

from __future__ import annotations

from dataclasses import replace

import pytest

import siesta
from siesta.bench import gemv as gemv_bench
from siesta.bench import moe_knobs
from siesta.bench.moe import summary_rows
from siesta.model import triton_gemv, triton_moe
from siesta.model.triton_moe import PairTiles


def _pair_tiles() -> tuple[PairTiles, PairTiles]:
    return triton_moe.GATE_UP_PAIR_TILES, triton_moe.DOWN_SUM_TILES


def _same(a, b) -> bool:
    """Equal settings, compared by their reprs: other test files reload the kernel modules (the
    interpreter reads TRITON_INTERPRET at definition), so a tile made before a reload is of
    another class than one made after, and dataclass equality says no."""
    return repr(a) == repr(b)


@pytest.fixture(scope="module")
def llm():
    engine = siesta.LLM("random:tiny-qwen3-moe", dtype="float32", max_model_len=256, device="cpu")
    yield engine
    del engine


def test_gemv_shapes_are_the_dense_matrices(llm) -> None:
    shape = llm.engine.runner.model.shape
    shapes = {s.name: s for s in moe_knobs.gemv_shapes(llm.engine.runner.model)}
    layers = shape.num_layers
    assert shapes["qkv_proj"].per_step == layers and shapes["o_proj"].per_step == layers
    assert shapes["gate"].n == shape.num_experts and shapes["gate"].per_step == len(shape.sparse_layers)
    assert all(s.k in (shape.hidden_size, shape.num_heads * shape.head_dim) for s in shapes.values())


def test_every_arm_is_timed_and_the_settings_come_back(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    before = moe_knobs.shipped(), dict(triton_gemv.ONE_ROW_SHAPES), _pair_tiles()
    recaptures: list[bool] = []
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "recapture_graphs", lambda decode_only=False: recaptures.append(decode_only))
    seen: list[tuple[moe_knobs.Knobs, dict]] = []
    real_decode = __import__("siesta.bench.moe", fromlist=["decode"]).decode

    def decode(*a, **kw):
        seen.append((moe_knobs.shipped(), dict(triton_gemv.ONE_ROW_SHAPES), _pair_tiles()))  # the settings as it runs
        return real_decode(*a, **kw)

    monkeypatch.setattr("siesta.bench.moe.decode", decode)
    monkeypatch.setattr(moe_knobs, "GEMV_WEIGHTS", ("qkv_proj.weight", "gate.weight"))  # the interpreter is slow
    out = moe_knobs.run(llm, [1, 2], 16, 2, rounds=1, candidates=gemv_bench.SMOKE_CANDIDATES,
                        pair_candidates=moe_knobs.SMOKE_PAIR_CANDIDATES)  # fmt: skip
    arms = moe_knobs.arms(before[0])
    swept = {tuple(map(int, key.split("x"))): triton_gemv.GemvConfig(**c) for key, c in out["tuned"].items()}
    tables = {"shipped": before[1], "swept": swept, "none": {}}
    # each arm decoded under its own settings, the GEMV table the one it names
    pairs = {"shipped": before[2], "swept": tuple(PairTiles(**out["pairs"][k]) for k in ("gate_up", "down_sum"))}
    assert _same(seen, [(replace(arm, gemv="shipped", pairs="shipped"), tables[arm.gemv], pairs[arm.pairs])
                        for arm in arms.values()])  # fmt: skip
    assert before[1] and swept != before[1]  # three different tables (the smoke candidates are not H100's)
    assert recaptures == [True] * (len(arms) + 1)  # one a switch, one to go back
    assert _same((moe_knobs.shipped(), triton_gemv.ONE_ROW_SHAPES, _pair_tiles()), before)
    for key in ("batch1", "batch2"):
        assert set(out[key]) == set(arms)
        assert out[key]["base"]["base_over_arm"] == 1.0
        assert all(arm["best_ms"] > 0 and len(arm["step_ms"]) == 1 for arm in out[key].values())
    # Each swept matrix's winner: a candidate, or the default it is timed beside (fp32: 4-byte elements).
    assert len(out["tuned"]) == len(out["gemv_sweep"]["shapes"]) == 2
    for key, config in out["tuned"].items():
        n, k = map(int, key.split("x"))
        assert triton_gemv.GemvConfig(**config) in (*gemv_bench.SMOKE_CANDIDATES, triton_gemv.default_config(1, n, k, 4))
    # The table's rows: each swept matrix, each arm but the base at each batch.
    labels = [row[0] for row in summary_rows({"knobs": out})]
    assert sum("one-row GEMV" in label for label in labels) == 2
    assert sum("knobs" in label for label in labels) == 2 * (len(arms) - 1)
    assert sum("pair kernel" in label for label in labels) == 2  # gate/up's and down-and-sum's winners


def test_an_arm_that_fails_is_recorded_and_the_others_still_run(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails under one arm's settings (as under a pinning thread) costs that arm,
    not the part: its error says where, and the base is still set against the rest."""
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "recapture_graphs", lambda decode_only=False: None)
    real_decode = __import__("siesta.bench.moe", fromlist=["decode"]).decode

    def decode(*a, **kw):
        if moe_knobs.shipped().route_warps == 4:
            raise RuntimeError("capture invalidated")
        return real_decode(*a, **kw)

    monkeypatch.setattr("siesta.bench.moe.decode", decode)
    monkeypatch.setattr(moe_knobs, "GEMV_WEIGHTS", ("gate.weight",))
    out = moe_knobs.run(llm, [1], 16, 2, rounds=2, candidates=gemv_bench.SMOKE_CANDIDATES[:1],
                        pair_candidates=moe_knobs.SMOKE_PAIR_CANDIDATES[:1])  # fmt: skip
    assert set(out["errors"]) == {"route4", "before"}  # the two arms with four-warp routing
    assert out["errors"]["route4"].startswith("RuntimeError: capture invalidated at File")
    assert set(out["batch1"]) == set(moe_knobs.arms(moe_knobs.shipped())) - {"route4", "before"}
    assert all(len(arm["step_ms"]) == 2 for arm in out["batch1"].values())


def test_the_pair_sweep_times_each_kernels_tiles_and_picks_a_winner_that_agrees(llm) -> None:
    """Each kernel's rows: the shipped tile first, then every candidate, each checked against the
    shipped output; the winner is the fastest that agrees, and the shipped tiles are back."""
    before = _pair_tiles()
    out = moe_knobs.pair_sweep(llm.engine.runner.model, moe_knobs.SMOKE_PAIR_CANDIDATES, top_k=2)
    assert _same(_pair_tiles(), before)
    assert out["layers"] == len(llm.engine.runner.model.shape.sparse_layers)
    for kernel, shipped in zip(("gate_up", "down_sum"), before):
        rows = out[kernel]["rows"]
        assert _same([PairTiles(**r["tiles"]) for r in rows], [shipped, *moe_knobs.SMOKE_PAIR_CANDIDATES])
        assert rows[0]["rel_err"] == 0.0 and all(r["rel_err"] < 1e-5 and r["us"] > 0 for r in rows)  # fp32
        assert out[kernel]["best"]["us"] == min(r["us"] for r in rows)


def test_a_dense_model_runs_every_arm_without_a_pair_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The part on a dense model (Llama): the choices it shares with the MoE (the GEMV table, the
    fused KV write and merge, the L2 prefetches) are A/B'd the same way; there are no experts to
    sweep, and the decode roofline counts no expert bytes."""
    dense = siesta.LLM("random:tiny-llama", dtype="float32", max_model_len=256, device="cpu")
    monkeypatch.setattr(dense.engine.runner, "recapture_graphs", lambda decode_only=False: None)
    monkeypatch.setattr(moe_knobs, "GEMV_WEIGHTS", ("o_proj.weight",))
    out = moe_knobs.run(dense, [1], 16, 2, rounds=1, candidates=gemv_bench.SMOKE_CANDIDATES[:1],
                        pair_candidates=moe_knobs.SMOKE_PAIR_CANDIDATES)  # fmt: skip
    assert out["pair_sweep"] == {"skipped": "the model has no experts"} and not out["errors"]
    assert _same(tuple(PairTiles(**out["pairs"][k]) for k in ("gate_up", "down_sum")), _pair_tiles())
    assert set(out["batch1"]) == set(moe_knobs.arms(moe_knobs.shipped()))
    decoded = __import__("siesta.bench.moe", fromlist=["decode"]).decode(dense, [1], 16, 2)["batch1"]
    assert decoded["experts_touched_per_layer"] == 0.0 and decoded["of_roofline"] > 0
