"""The logprob oracle's report, kept per numerics and served on /metrics: its key, the file it
is kept in, and an engine (offline, and as the server's EngineInfo carries it) serving the last
report of its own key as ``siesta_logprob_floor_ratio``."""

from __future__ import annotations

import os

import pytest
from transformers import AutoConfig

from siesta import LLM, fidelity_report
from siesta.cache_dir import CACHE_DIR_ENV
from siesta.ipc.handler import engine_info
from siesta.metrics import PREFIX, MetricsRegistry

MODEL = "random:tiny-llama"
NUMERICS = {"device": "cuda", "dtype": "torch.bfloat16", "kv_cache_dtype": "torch.bfloat16", "head_fp32": False,
            "deterministic": False}  # fmt: skip


def _report(ratio: float) -> dict:
    """One shape's oracle result as ``siesta.bench.fidelity.run_shape`` gives it (the parts read here)."""
    cells = {"1-64": {"siesta": 0.2 * ratio, "floor": 0.2, "ratio": ratio, "positions": 63},
             "64-256": {"siesta": 0.1, "floor": 0.0, "ratio": None, "positions": 3}}  # fmt: skip
    return {"shape": "tiny", "push_batch1": {"buckets": {"prompt": cells, "decode": {}}, "worst_ratio": ratio},
            "push_batch4": {"buckets": {"prompt": {}, "decode": {"1-64": dict(cells["1-64"], ratio=ratio / 2)}}},
            "engine_s": 1.0}  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    return tmp_path


def test_the_key_follows_the_architecture_and_the_arithmetic_not_the_rest():
    llama = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, vocab_size=256)  # fmt: skip
    key = fidelity_report.numerics_key(llama, **NUMERICS)
    assert key == fidelity_report.numerics_key(llama.to_dict(), **NUMERICS)
    named = llama.to_dict() | {"_name_or_path": "/somewhere/else", "transformers_version": "0"}
    assert fidelity_report.numerics_key(named, **NUMERICS) == key
    others = [NUMERICS | {"device": "cpu"}, NUMERICS | {"dtype": "torch.float32"},
              NUMERICS | {"kv_cache_dtype": "torch.float8_e4m3fn"}, NUMERICS | {"head_fp32": True},
              NUMERICS | {"deterministic": True}]  # fmt: skip
    assert len({key} | {fidelity_report.numerics_key(llama, **n) for n in others}) == 1 + len(others)
    assert fidelity_report.numerics_key(llama.to_dict() | {"num_hidden_layers": 3}, **NUMERICS) != key
    assert fidelity_report.numerics_key(llama.to_dict() | {"rope_theta": 1e6}, **NUMERICS) != key


def test_a_report_is_kept_whole_and_a_missing_or_broken_one_reads_as_none(cache):
    assert fidelity_report.load("k") is None
    path = fidelity_report.save("k", _report(1.2))
    assert path.parent == cache / fidelity_report.REPORT_DIR and fidelity_report.load("k") == _report(1.2)
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]  # no partial file left behind
    path.write_text("{not json")
    assert fidelity_report.load("k") is None


def test_the_ratios_of_a_report_by_run_kind_and_bucket():
    assert sorted(fidelity_report.floor_ratios(_report(1.2)), key=str) == sorted([
        ({"run": "push_batch1", "kind": "prompt", "bucket": "1-64"}, 1.2),
        ({"run": "push_batch4", "kind": "decode", "bucket": "1-64"}, 0.6),
    ], key=str)  # fmt: skip


def test_the_registry_serves_the_last_report_of_its_key(cache):
    metrics = MetricsRegistry()
    metrics.serve_fidelity("k")
    assert not any(name.startswith(PREFIX + "logprob") for name in metrics.as_dict())  # no run yet: no series
    fidelity_report.save("k", _report(1.2))
    fidelity_report.save("other", _report(9.0))
    served = metrics.as_dict()
    assert served[f'{PREFIX}logprob_floor_ratio{{bucket="1-64",kind="prompt",run="push_batch1"}}'] == 1.2
    assert served[f'{PREFIX}logprob_floor_ratio{{bucket="1-64",kind="decode",run="push_batch4"}}'] == 0.6
    assert served[f'{PREFIX}logprob_floor_ratio_worst{{run="push_batch1"}}'] == 1.2
    assert not any("64-256" in name for name in served)  # a bucket without a floor has no ratio
    # A later run replaces it, read at the next scrape.
    path = fidelity_report.save("k", {"shape": "tiny", "push_batch1": _report(1.4)["push_batch1"]})
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 1))
    text = metrics.exposition().decode()
    assert f'{PREFIX}logprob_floor_ratio_worst{{run="push_batch1"}} 1.4' in text
    assert "push_batch4" not in text


def test_an_engine_serves_the_report_of_its_own_numerics(cache):
    llm = LLM(MODEL, dtype="float32", kv_cache_bytes=1 << 22, max_model_len=256)
    engine = llm.engine
    expected = fidelity_report.numerics_key(engine.source.hf_config, device="cpu", dtype="torch.float32",
                                            kv_cache_dtype="torch.float32", head_fp32=False, deterministic=False)  # fmt: skip
    assert engine.numerics_key == expected
    assert engine_info(engine).numerics_key == expected  # what a server's frontend is told at Ready
    fidelity_report.save(expected, _report(1.1))
    assert llm.get_metrics()[f'{PREFIX}logprob_floor_ratio_worst{{run="push_batch1"}}'] == 1.1
