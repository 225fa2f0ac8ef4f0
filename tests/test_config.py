"""The engine's defaults are vLLM's (EngineArgs.get_batch_defaults), by device and entrypoint."""

from __future__ import annotations

import pytest
import torch

from siesta import config as cfg
from siesta.config import BatchDefaults, EngineConfig, SchedulerConfig, batch_defaults


class _Props:
    def __init__(self, name: str, gib: int) -> None:
        self.name, self.total_memory = name, gib << 30


@pytest.mark.parametrize("name,gib,usage,expected", [
    ("NVIDIA H200", 141, "api_server", BatchDefaults(8192, 1024)),
    ("NVIDIA H100 80GB HBM3", 80, "llm", BatchDefaults(16384, 1024)),
    ("NVIDIA A100-SXM4-80GB", 80, "api_server", BatchDefaults(2048, 256)),  # vLLM keeps A100s small (#17885)
    ("NVIDIA L4", 24, "llm", BatchDefaults(8192, 256)),
])  # fmt: skip
def test_gpu_defaults_follow_vllms_by_memory_and_name(monkeypatch, name, gib, usage, expected):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props(name, gib))
    assert batch_defaults(torch.device("cuda"), usage) == expected


def test_cpu_defaults_scale_with_the_ranks():
    assert batch_defaults(torch.device("cpu"), "llm", 1) == BatchDefaults(4096, 256)
    assert batch_defaults(torch.device("cpu"), "api_server", 2) == BatchDefaults(4096, 256)


def test_a_gpu_config_validated_where_there_is_none_takes_vllms_fallback():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")  # the fallback is for hosts without one
    assert batch_defaults(torch.device("cuda"), "api_server") == BatchDefaults(2048, 256)


def test_serve_and_the_offline_llm_resolve_their_own_defaults():
    for usage, tokens, seqs in (("llm", 4096, 256), ("api_server", 2048, 128)):
        config = EngineConfig.from_flags(model="random:tiny-llama", device="cpu", usage_context=usage)
        config.validate(max_model_len=8192)
        assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (tokens, seqs)


def test_what_the_user_sets_wins_and_no_chunking_takes_the_whole_context():
    config = EngineConfig.from_flags(model="random:tiny-llama", device="cpu", max_num_batched_tokens=512, max_num_seqs=8)
    config.validate(max_model_len=8192)
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (512, 8)
    unchunked = SchedulerConfig(enable_chunked_prefill=False)
    unchunked.resolve(8192, BatchDefaults(2048, 256))
    assert unchunked.max_num_batched_tokens == 8192


def test_bad_values_are_refused_by_name():
    with pytest.raises(cfg.ConfigError, match="usage_context"):
        EngineConfig.from_flags(model="random:tiny-llama", device="cpu", usage_context="gateway").validate(64)
    with pytest.raises(cfg.ConfigError, match="head_dtype"):
        EngineConfig.from_flags(model="random:tiny-llama", device="cpu", head_dtype="int8").validate(64)
    with pytest.raises(cfg.ConfigError, match="cpu threads"):
        EngineConfig.from_flags(model="random:tiny-llama", device="cpu", cpu_threads=0).validate(64)
    with pytest.raises(cfg.ConfigError, match="kv_cache_dtype='int8' is not supported: use one of auto, fp8"):
        EngineConfig.from_flags(model="random:tiny-llama", device="cpu", kv_cache_dtype="int8").validate(64)


def test_deterministic_mode_on_the_cpu_refuses_an_fp8_kv_cache_and_cuda_takes_it():
    kw = {"model": "random:tiny-llama", "kv_cache_dtype": "fp8", "deterministic": True}
    with pytest.raises(cfg.ConfigError, match="deterministic mode on the CPU .* fp8 KV cache"):
        EngineConfig.from_flags(device="cpu", **kw).validate(64)
    EngineConfig.from_flags(device="cuda", **kw).validate(64)  # the batch-invariant Triton kernels read fp8
