"""Hugging Face checkpoint directories: config.json plus safetensors shards.

The GGUF cache is written in this same layout, so its reads come through here too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from siesta.model.registry import check_model_type

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_GLOB = "*.safetensors"
# Any one of these means save_pretrained wrote a tokenizer here.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
GGUF_SUFFIX = ".gguf"
# 128 bits: collisions are out of the question, and the id stays short enough for paths.
FINGERPRINT_HEX_CHARS = 32

# (Hugging Face name, tensor) pairs, one tensor at a time.
Weights = Iterator[tuple[str, torch.Tensor]]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def digest(*parts: object) -> str:
    """A stable hex id of ``parts`` (unlike ``hash()``, the same in every process)."""
    joined = "\x00".join(str(part) for part in parts)
    return hashlib.sha256(joined.encode()).hexdigest()[:FINGERPRINT_HEX_CHARS]


def file_identity(path: Path) -> str:
    """Where a file is, how big, and when it last changed.

    Cheaper than hashing gigabytes on every start. Rewriting a file changes its
    mtime, so new weights get a new id; a copy elsewhere gets a new id too, which
    only costs a cache miss, never a wrong hit.
    """
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def load_config(directory: Path) -> PretrainedConfig:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{directory} has no {CONFIG_FILE}, so it is not a Hugging Face model directory")
    model_type = json.loads(config_path.read_text()).get("model_type")
    try:
        check_model_type(model_type)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    return AutoConfig.from_pretrained(directory)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it is sharded."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        missing = [name for name in shard_names if not (directory / name).is_file()]
        if missing:
            raise ValueError(f"{index_path} names shards that are not there: {', '.join(missing)}")
        return [directory / name for name in shard_names]
    files = sorted(directory.glob(SAFETENSORS_GLOB))
    if not files:
        raise ValueError(
            f"{directory} has no {SAFETENSORS_GLOB} files; siesta reads safetensors checkpoints only "
            "(save the model with save_pretrained(..., safe_serialization=True))"
        )
    return files


def iter_safetensors(files: list[Path], dtype: torch.dtype, device: torch.device | str) -> Weights:
    for path in files:
        with safe_open(path, framework="pt") as reader:
            for name in reader.keys():
                # Move first, then cast: the cast is far cheaper on an accelerator than on the host.
                yield name, reader.get_tensor(name).to(device).to(dtype)


def stored_dtype(files: list[Path]) -> torch.dtype | None:
    """The floating dtype most of the checkpoint's tensors have."""
    counts: Counter[str] = Counter()
    for path in files:
        with safe_open(path, framework="pt") as reader:
            counts.update(reader.get_slice(name).get_dtype() for name in reader.keys())
    floating = [(count, name) for name, count in counts.items() if name in _SAFETENSORS_DTYPES]
    return _SAFETENSORS_DTYPES[max(floating)[1]] if floating else None


def eos_token_ids(config: PretrainedConfig, directory: Path | None) -> list[int]:
    """Every id that ends generation: config.json's eos plus generation_config.json's list."""
    ids = _as_list(getattr(config, "eos_token_id", None))
    generation_path = None if directory is None else directory / GENERATION_CONFIG_FILE
    if generation_path is not None and generation_path.is_file():
        ids += _as_list(json.loads(generation_path.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer_folder(path: Path) -> None:
    """A ValueError naming what a tokenizer folder lacks, and the subfolders that have it."""
    if not path.is_dir() or has_tokenizer(path):
        return
    inside = sorted(str(p.parent) for name in TOKENIZER_FILES for p in path.glob(f"*/{name}"))
    hint = f"; these subfolders have one: {', '.join(dict.fromkeys(inside))}" if inside else ""
    raise ValueError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}){hint}")


def load_tokenizer_from(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """A tokenizer from a directory, a .gguf file, or anything AutoTokenizer resolves."""
    path = Path(path).expanduser()
    if path.suffix == GGUF_SUFFIX and path.is_file():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    check_tokenizer_folder(path)
    return AutoTokenizer.from_pretrained(path)


@dataclass
class HFCheckpoint:
    """A model directory as ``save_pretrained`` writes it."""

    directory: Path
    tokenizer_path: str | None = None
    hf_config: PretrainedConfig = field(init=False)
    files: list[Path] = field(init=False)

    def __post_init__(self) -> None:
        if not self.directory.is_dir():
            raise ValueError(f"{self.directory} is not a directory")
        self.hf_config = load_config(self.directory)
        self.files = weight_files(self.directory)

    @property
    def name(self) -> str:
        return self.directory.resolve().name

    @property
    def path(self) -> str:
        return str(self.directory)

    @property
    def fingerprint(self) -> str:
        described = [self.directory / CONFIG_FILE, *self.files]
        return digest("hf", *(file_identity(path) for path in described))

    @property
    def checkpoint_dtype(self) -> torch.dtype | None:
        return stored_dtype(self.files)

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.hf_config, self.directory)

    def iter_weights(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Weights:
        return iter_safetensors(self.files, dtype, device)

    def load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        if self.tokenizer_path is not None:
            return load_tokenizer_from(self.tokenizer_path)
        return AutoTokenizer.from_pretrained(self.directory) if has_tokenizer(self.directory) else None
