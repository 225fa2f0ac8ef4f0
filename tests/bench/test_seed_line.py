"""The GPU bench's ``seed_line`` section: the seed's serve line as given, run on the CPU in a small
configuration (extra flags only here), so the H200 run cannot break on a path, a flag or a key."""

from __future__ import annotations

import argparse
import json

from siesta.bench import gpu
from siesta.bench.resume_http import DEFAULT_TOKENIZER
from siesta.bench.seed_line import SEED_ENV, SEED_FLAGS, SEED_PORT, SeedLine, last_burst, model_folder
from siesta.entrypoints.cli import build_parser
from siesta.entrypoints.engine_args import engine_config
from siesta.model.loader import resolve_model

# CPU only: a small tier and KV pool and a short context, after the seed's own flags (the last wins).
CPU_EXTRA = ('--kv-transfer-config {"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
             '"kv_connector_extra_config":{"block_size":16,"cpu_bytes_to_use":67108864}} '
             "--kv-cache-bytes 64M --max-model-len 2048")  # fmt: skip


def test_the_line_is_the_seeds_and_means_what_it_says_in_vllm(tmp_path) -> None:
    model = model_folder("tiny-llama", DEFAULT_TOKENIZER, tmp_path)
    cmd = SeedLine(model).command(SEED_PORT)
    assert cmd[cmd.index("serve") + 1 :] == [model, *SEED_FLAGS]
    args = build_parser().parse_args(cmd[cmd.index("serve") :])
    config = engine_config(args)
    assert (args.port, args.served_model_name, config.model.max_model_len) == (SEED_PORT, ["dsv41"], 65536)
    assert config.cache.enable_prefix_caching and config.cache.gpu_memory_utilization == 0.85
    extra = config.kv_transfer.kv_connector_extra_config
    assert (config.kv_transfer.kv_connector, extra) == ("OffloadingConnector", {"block_size": 128, "cpu_bytes_to_use": 32 << 30})
    assert SEED_ENV == {"VLLM_SERVER_DEV_MODE": "1"}
    assert config.usage_context == "api_server"  # so vLLM's server defaults apply: no flag sets the budget


def test_random_dir_takes_the_folders_architecture_and_tokenizer(tmp_path) -> None:
    model = model_folder("tiny-llama", DEFAULT_TOKENIZER, tmp_path)
    source = resolve_model(model)
    assert source.hf_config.hidden_size == 64 and source.load_tokenizer() is not None
    assert resolve_model(model + "@7").fingerprint != source.fingerprint  # a seed suffix, as for named shapes


def test_last_burst_is_the_steps_after_the_last_pause() -> None:
    step = {"tokens": 5, "decode_rows": 1, "prefill_rows": 1, "loading": 0}
    steps = [step | {"start_s": 0.0, "end_s": 0.1}, step | {"start_s": 1.0, "end_s": 1.1},
             step | {"start_s": 1.15, "end_s": 1.2, "loading": 2}]  # fmt: skip
    assert last_burst(steps) == {"steps": 2, "seconds": 0.2, "tokens": 10, "prefill_tokens": 8,
                                 "steps_with_prefill": 2, "max_step_s": 0.1, "max_loading": 2}  # fmt: skip


def test_the_section_runs_the_seed_client_against_the_line() -> None:
    args = gpu.build_parser().parse_args([])
    small = {"resume_requests": 2, "http_prompt_words": 40, "seed_line_shapes": ["smollm2-135m"],
             "http_tokenizer": str(DEFAULT_TOKENIZER), "seed_line_extra": CPU_EXTRA}
    args = argparse.Namespace(**(vars(args) | small))
    out = gpu.seed_line(args)
    json.dumps(out)
    summary = gpu.summary({"seed_line": out})
    out = out["smollm2-135m"]
    assert out["burst_kv"]["tier_GiB"] == 32 and 0 < out["burst_kv"]["GiB"] < 1
    kept = out["seed_client"]["kept"]["metric_delta"]
    assert kept["siesta_external_prefix_cache_hits_total"] > 0  # the tier was kept and read back
    assert out["kept_replay_steps"]["steps"] > 0 and out["speedup_p50"] > 0
    assert ["seed's serve line as given, smollm2-135m (p50 speedup)"] == [r[0] for r in summary if "seed's" in r[0]]
