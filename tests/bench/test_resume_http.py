"""The GPU bench's ``resume_http`` section, run on the CPU in a tiny configuration, so that the
H200 run cannot break on a path, a flag or a key: ``siesta serve`` with a random model and the
repo's tokenizer folder, the seed's client unchanged, then the in-process experiment."""

from __future__ import annotations

import argparse
import math

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from siesta.bench import gpu
from siesta.bench.resume_http import DEFAULT_TOKENIZER, SEED_CLIENT, ServeOptions

VOCAB = 49152  # the tokenizer's: every id it makes must be in the model's vocabulary
BLOCK = 16
REQUESTS = 2
WORDS = 40  # the seed client's --prompt-tokens: ~270 tokens, a dozen tier blocks per prompt
KV_BYTES = 32 << 20


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _args(model: str) -> argparse.Namespace:
    args = gpu.build_parser().parse_args([])
    return argparse.Namespace(**(vars(args) | dict(
        model=model, device="cpu", max_model_len=1024, max_num_batched_tokens=512, resume_requests=REQUESTS,
        resume_tokens=0, tier_block_size=BLOCK, tier_bytes=64 << 20, load_window_mib=None,
        http_tokenizer=str(DEFAULT_TOKENIZER), http_prompt_words=WORDS, http_kv_cache_bytes=KV_BYTES,
    )))  # fmt: skip


def test_the_tokenizer_folder_and_the_seed_client_travel_with_the_repo() -> None:
    assert (DEFAULT_TOKENIZER / "tokenizer.json").is_file() and SEED_CLIENT.is_file()


def test_the_server_command_names_the_tier_the_tokenizer_and_a_size() -> None:
    cmd = ServeOptions(model="random:llama-3-8b").command(8123)
    assert cmd[cmd.index("serve") + 1] == "random:llama-3-8b"
    assert cmd[cmd.index("--tokenizer") + 1] == str(DEFAULT_TOKENIZER)
    assert '"kv_connector": "OffloadingConnector"' in cmd[cmd.index("--kv-transfer-config") + 1]
    assert "--gpu-memory-utilization" in cmd and "--kv-cache-bytes" not in cmd
    cpu = ServeOptions(model="m", kv_cache_bytes=KV_BYTES, device="cpu").command(8123)
    assert cpu[cpu.index("--kv-cache-bytes") + 1] == str(KV_BYTES) and "--gpu-memory-utilization" not in cpu


def test_resume_http_runs_both_arms_over_http_and_in_process(tiny_model: str) -> None:
    out = gpu.resume_http(_args(tiny_model))
    seed = out["http"]["seed_client"]
    assert set(seed) == {"cleared", "kept", "verdict"}
    kept, cleared = seed["kept"]["metric_delta"], seed["cleared"]["metric_delta"]
    # The counters are the evidence (timings on a tiny CPU model are not): the kept arm's replay
    # hits the tier and loads from it; the cleared arm's loads nothing.
    hits = "siesta_external_prefix_cache_hits_total"
    load = 'siesta_kv_offload_load_bytes_total{tier="host"}'
    assert kept.get(hits, 0) > 0 and kept.get(load, 0) > 0
    assert cleared.get(hits, 0) == 0 and cleared.get(load, 0) == 0
    # The in-process arm ran at the prompt length the server's tokenizer gives the seed's prompts.
    assert out["in_process"]["prompt_tokens"] == out["prompt_tokens"] > WORDS
    assert out["in_process"]["kept"]["metric_delta"].get(load, 0) > 0
    assert math.isfinite(out["kept_replay_http_over_in_process"]) and out["kept_replay_http_over_in_process"] > 0
    # The replays after the seed's arms load the same bytes again, and each side's link rate is read.
    replays = out["http"]["kept_replays"]
    assert len(replays) == _args(tiny_model).resume_replays - 1
    assert all(r["load_bytes"] == kept[load] and r["link_gbps"] > 0 for r in replays)
    assert out["link_gbps_http"] > 0 and out["link_gbps_in_process"] > 0
    assert "kept_sync" not in out["in_process"], "the HTTP client has the seed's two arms only"
    rows = {row[0]: row for row in gpu.summary({"resume_http": out})}
    assert rows["seed client over HTTP (p50 speedup)"][1] == out["seed_client_speedup_p50"]
