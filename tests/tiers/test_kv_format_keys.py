"""Tier entries are keyed by what their bytes mean: an engine never loads KV of another cache
format (fp8 against the model's dtype, e4m3 against e5m2) from a disk tier they share, across
restarts, and loads its own format's entries there as before."""

from __future__ import annotations

import pytest
import torch

from siesta import LLM, SamplingParams

MODEL = "random:tiny-llama"
BLOCK, TIER_BLOCK = 16, 32
HITS = "siesta_external_prefix_cache_hits_total"
DISK_LOADS = 'siesta_kv_offload_load_bytes_total{tier="disk"}'
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def engine(kv_cache_dtype: str, disk_path: str) -> LLM:
    extra = {"block_size": TIER_BLOCK, "cpu_bytes_to_use": 1 << 24, "disk_path": disk_path,
             "disk_bytes_to_use": 1 << 26}  # fmt: skip
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return LLM(MODEL, dtype="float32", kv_cache_bytes=1 << 22, max_model_len=512, kv_cache_dtype=kv_cache_dtype,
               kv_transfer_config=tier)  # fmt: skip


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (TIER_BLOCK * 3 + 5, TIER_BLOCK * 2 + 9)]


def serve(llm: LLM, ps: list[list[int]]) -> tuple[list[list[int]], dict[str, float]]:
    """The tokens, and the tier counters, of one run that ends with the engine closed (its stores
    on the disk)."""
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], PARAMS, use_tqdm=False)]
    llm.engine.close()
    return outs, llm.get_metrics()


@pytest.mark.parametrize(("writer", "reader"), [("fp8", "auto"), ("auto", "fp8"), ("fp8", "fp8_e5m2")])
def test_a_shared_disk_tier_serves_each_kv_format_only_its_own_entries(tmp_path, writer: str, reader: str) -> None:
    ps = prompts()
    full_blocks = sum((len(p) - 1) // BLOCK * BLOCK for p in ps)
    written, _ = serve(engine(writer, str(tmp_path)), ps)
    files = len(list(tmp_path.rglob("*.kv")))
    assert files > 0, "the first engine stored its entries on the disk"
    _, other = serve(engine(reader, str(tmp_path)), ps)
    assert other.get(HITS, 0.0) == 0 and other.get(DISK_LOADS, 0.0) == 0
    # Under keys of its own, not the same keys of other bytes (an entry of another size misses too).
    assert len(list(tmp_path.rglob("*.kv"))) == 2 * files
    again, same = serve(engine(writer, str(tmp_path)), ps)  # a restart of the first format: both kinds on disk
    assert same[HITS] == full_blocks and same[DISK_LOADS] > 0
    assert again == written
