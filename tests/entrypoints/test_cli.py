"""``siesta serve`` takes the command line a vLLM user pastes; what it cannot honour gets a
one-line answer naming the flag (exit 2), never a traceback or a silent no-op."""

from __future__ import annotations

import json

import pytest

from siesta.entrypoints.cli import build_parser, engine_config, main

# The seed's own serve command (its tensor-parallel size aside), on a small random model.
TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"block_size": 128, "cpu_bytes_to_use": 34359738368}}  # fmt: skip
SEED_SERVE = ["serve", "random:tiny-llama", "--served-model-name", "dsv41", "--enable-prefix-caching",
              "--max-model-len", "65536", "--gpu-memory-utilization", "0.85", "--port", "8712",
              "--kv-transfer-config", json.dumps(TIER), "--device", "cuda"]  # fmt: skip


def _config(argv: list[str]):
    return engine_config(build_parser().parse_args(argv))


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 or err.startswith("usage:"), err  # one line, or argparse's usage + error
    return err


def test_the_seeds_serve_command_parses_with_vllms_meanings():
    config = _config(SEED_SERVE)
    assert config.cache.enable_prefix_caching and config.cache.gpu_memory_utilization == 0.85
    assert config.model.max_model_len == 65536 and config.kv_transfer.kv_connector == "OffloadingConnector"


def test_vllms_other_flags_are_taken():
    argv = ["serve", "random:tiny-llama", "--no-enable-prefix-caching", "--tensor-parallel-size", "1",
            "--kv-cache-dtype", "auto", "--disable-log-requests", "--disable-log-stats", "--generation-config", "vllm",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--enforce-eager", "--trust-remote-code",
            "--dtype", "float32", "--seed", "3", "--uvicorn-log-level", "warning"]  # fmt: skip
    args = build_parser().parse_args(argv)
    config = engine_config(args)
    assert not config.cache.enable_prefix_caching and config.enforce_eager and config.model.seed == 3
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_num_batched_tokens == 512
    assert args.uvicorn_log_level == "warning"


def test_the_kv_pool_is_written_at_start_up_when_asked_and_by_the_throughput_bench():
    assert not _config(["serve"]).cache.prefault_kv_cache
    assert _config(["serve", "--prefault-kv-cache"]).cache.prefault_kv_cache
    assert _config(["bench", "throughput"]).cache.prefault_kv_cache
    assert not _config(["bench", "throughput", "--no-prefault-kv-cache"]).cache.prefault_kv_cache


@pytest.mark.parametrize(("size", "expected"), [("4294967296", 1 << 32), ("1G", 1 << 30), ("512MiB", 512 << 20),
                                               ("1.5GB", 1_500_000_000), ("64k", 64 << 10)])  # fmt: skip
def test_sizes_take_units(size, expected):
    assert _config(["serve", "--kv-cache-bytes", size]).cache.kv_cache_bytes == expected


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0"),
        (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype fp8_inc"),
        (["--generation-config", "auto"], "--generation-config auto"),
        (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent"),
        (["--kv-cache-bytes", "1X"], "--kv-cache-bytes"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(flags, named, capsys):
    assert named in _refusal(["serve", *flags], capsys)


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_the_kv_cache_dtypes_vllm_and_sglang_name_reach_the_config(name):
    assert _config(["serve", "--kv-cache-dtype", name]).cache.kv_cache_dtype == name


def test_an_unsupported_kv_cache_dtype_is_refused_saying_what_is_accepted(capsys):
    err = _refusal(["serve", "--kv-cache-dtype", "int8"], capsys)
    assert "--kv-cache-dtype int8" in err and "fp8_e4m3" in err and "auto" in err


def test_tensor_parallel_size_reaches_the_config():
    assert _config(["serve", "--tensor-parallel-size", "2"]).parallel.tensor_parallel_size == 2
    assert _config(["serve", "-tp", "4"]).parallel.tensor_parallel_size == 4
    assert _config(["serve"]).parallel.tensor_parallel_size == 1


def test_gpu_memory_utilization_on_the_cpu_says_it_does_nothing(capsys):
    _config(["serve", "--device", "cpu", "--gpu-memory-utilization", "0.5"])
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization 0.5 has no effect on the CPU" in err and "--kv-cache-bytes" in err
    _config(["serve", "--device", "cpu"])
    assert capsys.readouterr().err == ""  # left out: nothing to say


def test_generate_given_a_model_directory_points_to_model(tmp_path, capsys):
    err = _refusal(["generate", str(tmp_path)], capsys)
    assert f"--model {tmp_path}" in err


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve"]])
def test_every_engine_flag_is_an_argument_of_llm(command):
    # ``siesta generate`` and the benches build ``LLM(**engine_kwargs(args))``: a flag LLM does
    # not take would crash them before the model loads.
    import inspect

    from siesta import LLM
    from siesta.entrypoints.engine_args import engine_kwargs

    kwargs = engine_kwargs(build_parser().parse_args(command))
    inspect.signature(LLM).bind(**kwargs)


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve"], ["bench", "resume"]])
def test_the_engine_flags_are_declared_once(command):
    # EngineFlags declares each flag's name and default; LLM, EngineConfig.from_flags and the command
    # line take exactly those, with those defaults.
    import dataclasses
    import inspect

    from siesta import LLM
    from siesta.config import EngineConfig, EngineFlags
    from siesta.entrypoints.engine_args import FLAGS, engine_kwargs

    declared = {f.name: f.default for f in dataclasses.fields(EngineFlags)}
    assert sorted(f.name for f in FLAGS) == sorted(declared)
    llm = {p.name: p.default for p in inspect.signature(LLM).parameters.values()}
    assert llm == declared
    assert engine_kwargs(build_parser().parse_args(command)) == declared
    assert EngineConfig.from_flags(**declared) == EngineConfig.from_flags()


def test_the_flags_other_spellings_set_the_same_fields():
    assert not _config(["serve", "--no-prefix-caching"]).cache.enable_prefix_caching
    assert not _config(["serve", "--no-enable-prefix-caching"]).cache.enable_prefix_caching
    assert _config(["serve", "-tp", "1"]).parallel.tensor_parallel_size == 1
    assert not _config(["serve", "--no-enable-sleep-mode"]).enable_sleep_mode
    assert _config(["serve"]).enable_sleep_mode


def test_cpu_threads_and_the_fp32_head_are_flags():
    assert _config(["serve", "--cpu-threads", "3"]).cpu.threads == 3
    assert _config(["serve"]).cpu.threads is None
    assert _config(["serve", "--head-dtype", "float32"]).model.head_fp32
    assert _config(["serve", "--enable-fp32-lm-head"]).model.head_fp32  # SGLang's name
    assert not _config(["serve"]).model.head_fp32


def test_a_tokenizer_folder_without_tokenizer_files_is_one_line_naming_the_subfolder_that_has_them(capsys):
    from siesta.bench.resume_http import DEFAULT_TOKENIZER

    err = _refusal(["serve", "random:tiny-llama", "--tokenizer", str(DEFAULT_TOKENIZER.parent)], capsys)
    assert len(err.splitlines()) == 1 and "holds no tokenizer" in err and str(DEFAULT_TOKENIZER) in err


def test_vllms_dev_mode_variable_opens_the_control_routes_too(monkeypatch):
    from siesta.entrypoints.server.state import dev_mode_from_env

    monkeypatch.delenv("SIESTA_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not dev_mode_from_env()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the seed's serve line sets it
    assert dev_mode_from_env()
