"""GGUF files, converted once into a Hugging Face directory that later loads read.

Converting means: build a transformers config from the metadata, dequantize every
tensor to fp32, give it its Hugging Face name and shape, and undo the row order
llama.cpp's converter gives Llama q/k projections. The result lives under the
cache directory, keyed by the file's fingerprint; it is written to a temporary
directory and renamed into place, so a killed conversion never leaves half a cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import struct
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from siesta.cache_dir import cache_dir
from siesta.model.hf_loader import (
    CONFIG_FILE,
    GGUF_SUFFIX,
    Weights,
    digest,
    eos_token_ids,
    file_identity,
    iter_safetensors,
    load_tokenizer_from,
)
from siesta.model.layers import inverse_frequencies

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor


GGUF_INSTALL = "pip install gguf"

GGUF_CACHE_SUBDIR = "gguf"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_SUBDIR = "tokenizer"
MANIFEST_FILE = "siesta_manifest.json"
# Bump when the cache layout or the conversion changes, so old entries are redone.
CACHE_FORMAT_VERSION = 1

# GGUF architecture -> transformers model_type.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama.cpp interleaves the q/k rows of these for its rope kernel; Qwen's are left as they are.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})
DEFAULT_ROPE_THETA = 10000.0
# llama.cpp stores Llama 3 rope scaling only as per-frequency factors (rope_freqs);
# these are the settings every Llama 3.x release uses besides the factor itself.
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_FACTORS_RTOL = 1e-3

ROPE_FREQS_TENSOR = "rope_freqs.weight"
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_BLOCK_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")

# safetensors: an 8-byte little-endian header length, a JSON header, then raw data.
_HEADER_LENGTH_FORMAT = "<Q"
_HEADER_ALIGNMENT = 8
_FP32_BYTES = 4
# A quantization tag ending a file name: .Q4_1, .Q4_K_M, .IQ2_XS, .TQ1_0, .F16, .BF16.
_QUANT_SUFFIX = re.compile(r"\.(?:[IT]?Q\d\w*|B?F(?:16|32|64))$", re.IGNORECASE)


def _gguf() -> ModuleType:
    """The gguf package: only converting needs it, so a cached conversion loads without it."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError(f"converting a GGUF file needs the gguf package: {GGUF_INSTALL}") from error
    return gguf


def open_reader(path: Path) -> GGUFReader:
    return _gguf().GGUFReader(path)


def dequantize(data: np.ndarray, quant_type: GGMLQuantizationType) -> np.ndarray:
    return _gguf().quants.dequantize(data, quant_type)


def cache_root() -> Path:
    return cache_dir()


def display_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


# -- names and layouts ------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match["part"] not in _BLOCK_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in the Llama family")
    return f"model.layers.{match['layer']}.{_BLOCK_TENSORS[match['part']]}.{match['kind']}"


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ggml's ne), the reverse of torch's order.
    return tuple(int(dim) for dim in reversed(tensor.shape))


def undo_rope_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: per head, rows went from (half, pair) order to
    interleaved pairs; put each head's two halves back one after the other."""
    half = rows.shape[0] // num_heads // 2
    per_head = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return per_head.swapaxes(1, 2).reshape(rows.shape)


def _heads_if_permuted(hf_name: str, config: PretrainedConfig) -> int | None:
    """The head count to unpermute ``hf_name`` with, or None when it is stored as is."""
    if config.model_type not in _PERMUTED_ARCHITECTURES:
        return None
    if ".self_attn.q_proj." in hf_name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def weight_tensors(reader: GGUFReader) -> list[ReaderTensor]:
    # rope_freqs is rope scaling, which the config carries instead.
    return [tensor for tensor in reader.tensors if tensor.name != ROPE_FREQS_TENSOR]


def hf_layout(reader: GGUFReader) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, torch shape) of every weight, in file order."""
    return [(hf_tensor_name(tensor.name), torch_shape(tensor)) for tensor in weight_tensors(reader)]


def hf_tensors(reader: GGUFReader, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Every weight as (Hugging Face name, fp32 array in Hugging Face layout), in file order."""
    for tensor in weight_tensors(reader):
        name = hf_tensor_name(tensor.name)
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape(torch_shape(tensor))
        heads = _heads_if_permuted(name, config)
        yield name, values if heads is None else undo_rope_permute(values, heads)


# -- config -----------------------------------------------------------------------


@dataclass
class _Metadata:
    reader: GGUFReader
    architecture: str

    def get(self, key: str, default: Any = None) -> Any:
        field_ = self.reader.fields.get(key.format(arch=self.architecture))
        return default if field_ is None else field_.contents()

    def tensor(self, name: str) -> ReaderTensor | None:
        return next((tensor for tensor in self.reader.tensors if tensor.name == name), None)


def config_from_metadata(reader: GGUFReader) -> PretrainedConfig:
    keys = _gguf().Keys
    architecture = reader.fields[keys.General.ARCHITECTURE].contents()
    if architecture not in _ARCHITECTURES:
        supported = ", ".join(_ARCHITECTURES)
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; siesta reads {supported}")
    meta = _Metadata(reader, architecture)
    hidden = meta.get(keys.LLM.EMBEDDING_LENGTH)
    heads = meta.get(keys.Attention.HEAD_COUNT)
    head_dim = meta.get(keys.Attention.KEY_LENGTH) or hidden // heads
    embeddings = meta.tensor("token_embd.weight")
    return AutoConfig.for_model(
        _ARCHITECTURES[architecture],
        vocab_size=torch_shape(embeddings)[0],
        hidden_size=hidden,
        intermediate_size=meta.get(keys.LLM.FEED_FORWARD_LENGTH),
        num_hidden_layers=meta.get(keys.LLM.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=meta.get(keys.Attention.HEAD_COUNT_KV) or heads,
        head_dim=head_dim,
        rms_norm_eps=meta.get(keys.Attention.LAYERNORM_RMS_EPS),
        max_position_embeddings=meta.get(keys.LLM.CONTEXT_LENGTH),
        rope_parameters=_rope_parameters(meta, head_dim),
        attention_bias=meta.tensor("blk.0.attn_q.bias") is not None,
        tie_word_embeddings=meta.tensor("output.weight") is None,
        bos_token_id=meta.get(keys.Tokenizer.BOS_ID),
        eos_token_id=_eos_token_id(meta),
        pad_token_id=meta.get(keys.Tokenizer.PAD_ID),
    )


def _eos_token_id(meta: _Metadata) -> int | list[int] | None:
    """End of sequence, plus llama.cpp's end-of-turn and end-of-message ids when present."""
    tokenizer = _gguf().Keys.Tokenizer
    keys = (tokenizer.EOS_ID, tokenizer.EOT_ID, tokenizer.EOM_ID)
    ids = list(dict.fromkeys(token for token in map(meta.get, keys) if token is not None))
    if len(ids) <= 1:
        return ids[0] if ids else None
    return ids


def _rope_parameters(meta: _Metadata, head_dim: int) -> dict[str, Any]:
    rope = _gguf().Keys.Rope
    theta = float(meta.get(rope.FREQ_BASE, DEFAULT_ROPE_THETA))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get(rope.SCALING_TYPE, "none")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(meta.get(rope.SCALING_FACTOR)))
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (none, linear, or Llama 3 rope_freqs)")
    factors = meta.tensor(ROPE_FREQS_TENSOR)
    if factors is not None:
        params = _llama3_rope(theta, head_dim, torch.from_numpy(dequantize(factors.data, factors.tensor_type).copy()))
    return params


def _llama3_rope(theta: float, head_dim: int, factors: torch.Tensor) -> dict[str, Any]:
    """Recover Llama 3 rope scaling from llama.cpp's per-frequency divisors, checking they match."""
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factors.max()), **LLAMA3_ROPE_DEFAULTS}
    plain = inverse_frequencies(head_dim, {"rope_type": "default", "rope_theta": theta})
    implied = plain / inverse_frequencies(head_dim, params)
    if not torch.allclose(implied, factors.float().flatten(), rtol=ROPE_FACTORS_RTOL):
        raise ValueError("GGUF rope_freqs do not match Llama 3 rope scaling; siesta cannot express them")
    return params


# -- writing the cache ------------------------------------------------------------


def write_safetensors(
    path: Path, layout: list[tuple[str, tuple[int, ...]]], tensors: Iterator[tuple[str, np.ndarray]]
) -> None:
    """Stream fp32 arrays into one safetensors file, holding one tensor in memory at a time.

    The header comes first and needs every shape, hence ``layout`` up front.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in layout:
        size = prod(shape) * _FP32_BYTES
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % _HEADER_ALIGNMENT)
    with path.open("wb") as out:
        out.write(struct.pack(_HEADER_LENGTH_FORMAT, len(blob)))
        out.write(blob)
        for (name, shape), (got_name, array) in zip(layout, tensors, strict=True):
            if (got_name, array.shape) != (name, shape):
                raise ValueError(f"got {got_name} {array.shape} where the header says {name} {shape}")
            out.write(np.ascontiguousarray(array, dtype="<f4").tobytes())
        _flush_to_disk(out)


def _flush_to_disk(file: Any) -> None:
    # A rename that outlives a crash must not point at data that did not.
    file.flush()
    os.fsync(file.fileno())


@dataclass(frozen=True)
class CacheEntry:
    directory: Path
    fingerprint: str

    @property
    def manifest(self) -> dict[str, Any]:
        return {
            "format": CACHE_FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "files": {name: (self.directory / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE)},
        }

    def is_complete(self) -> bool:
        """True only for an entry a finished conversion wrote and nothing has cut short since."""
        try:
            written = json.loads((self.directory / MANIFEST_FILE).read_text())
            return written == self.manifest
        except (OSError, ValueError):
            return False


def convert(gguf_path: Path, entry: CacheEntry) -> None:
    """Write ``entry`` from ``gguf_path``, atomically."""
    reader = open_reader(gguf_path)
    config = config_from_metadata(reader)
    with _staged(entry.directory) as staging:
        config.to_json_file(staging / CONFIG_FILE)
        write_safetensors(staging / WEIGHTS_FILE, hf_layout(reader), hf_tensors(reader, config))
        (staging / MANIFEST_FILE).write_text(json.dumps(CacheEntry(staging, entry.fingerprint).manifest))


@contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A temporary sibling of ``target`` that becomes ``target`` if the block finishes."""
    prefix = f".{target.name}.tmp-{socket.gethostname()}-"
    staging = target.parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex}"
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target.parent, prefix)
    staging.mkdir()
    try:
        yield staging
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """One process at a time checks and builds ``target`` (tensor-parallel ranks start together)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _publish(staging: Path, target: Path) -> None:
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        # Another process finished first; its copy is as good as ours.


def _remove_abandoned(parent: Path, prefix: str) -> None:
    """Delete staging directories whose process (on this host) died mid-conversion."""
    for child in parent.glob(f"{prefix}*"):
        pid = int(child.name[len(prefix) :].split("-")[0])
        if not _process_alive(pid):
            shutil.rmtree(child, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _discard(directory: Path) -> None:
    # Move aside first: a half-deleted directory must never look like an entry.
    if directory.exists():
        trash = directory.with_name(f".{directory.name}.trash-{uuid.uuid4().hex}")
        directory.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


# -- the checkpoint ---------------------------------------------------------------


@dataclass
class GGUFCheckpoint:
    gguf_path: Path
    tokenizer_path: str | None = None
    fingerprint: str = field(init=False)
    entry: CacheEntry = field(init=False)
    hf_config: PretrainedConfig = field(init=False)

    def __post_init__(self) -> None:
        if self.gguf_path.suffix != GGUF_SUFFIX or not self.gguf_path.is_file():
            raise ValueError(f"{self.gguf_path} is not a {GGUF_SUFFIX} file")
        self.fingerprint = digest("gguf", file_identity(self.gguf_path))
        self.entry = CacheEntry(cache_root() / GGUF_CACHE_SUBDIR / self.fingerprint, self.fingerprint)
        with _locked(self.entry.directory):
            if not self.entry.is_complete():
                _discard(self.entry.directory)
                convert(self.gguf_path, self.entry)
        self.hf_config = AutoConfig.from_pretrained(self.entry.directory)

    @property
    def name(self) -> str:
        return display_name(self.gguf_path)

    @property
    def path(self) -> str:
        return str(self.gguf_path)

    @property
    def checkpoint_dtype(self) -> torch.dtype | None:
        return None  # quantized, or at least not one dtype the engine should mimic

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.hf_config, self.entry.directory)

    def iter_weights(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Weights:
        return iter_safetensors([self.entry.directory / WEIGHTS_FILE], dtype, device)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer_path is not None:
            return load_tokenizer_from(self.tokenizer_path)
        cached = self.entry.directory / TOKENIZER_SUBDIR
        with _locked(cached):
            if cached.is_dir():
                try:
                    return AutoTokenizer.from_pretrained(cached)
                except (OSError, ValueError):
                    _discard(cached)  # damaged since it was written: rebuild it
            # transformers rebuilds the tokenizer from GGUF metadata slowly (seconds); do it once.
            tokenizer = load_tokenizer_from(self.gguf_path)
            with _staged(cached) as staging:
                tokenizer.save_pretrained(staging)
            return tokenizer
