"""The logprob oracle's last verdict, kept per numerics and served on ``/metrics``.

The oracle (``siesta.bench.fidelity``; ``bash bench/gpu.sh --sections fidelity`` on a GPU) scores
an engine against a transformers trainer in units of the trainer's own bf16-vs-fp32 error. What it
finds depends on the architecture and on how the engine computes (device, dtype, KV cache dtype,
head dtype, deterministic mode), not on the weights' values: a trainer's default init stands for
its checkpoints. So each run's report is kept under the cache directory by a key of those, and an
engine whose key matches serves the last one as ``siesta_logprob_floor_ratio{run,kind,bucket}``
beside its other metrics, where an RL framework's dashboards already read.

Below the engine and the metrics registry: it reads configs and files, nothing else of siesta's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from siesta.cache_dir import cache_dir

REPORT_DIR = "fidelity"
# The config fields that decide an architecture's numerics (absent ones are left out of the key).
ARCHITECTURE_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob",
)  # fmt: skip


def numerics_key(hf_config: Any, *, device: str, dtype: str, kv_cache_dtype: str, head_fp32: bool,
                 deterministic: bool) -> str:  # fmt: skip
    """A short key of an engine's architecture and arithmetic: equal keys compute alike."""
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    described = {name: config[name] for name in ARCHITECTURE_FIELDS if config.get(name) is not None}
    described |= {"device": device, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "head_fp32": head_fp32,
                  "deterministic": deterministic}  # fmt: skip
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def report_path(key: str) -> Path:
    return cache_dir() / REPORT_DIR / f"{key}.json"


def save(key: str, report: Mapping[str, Any]) -> Path:
    """Keep ``report`` (one shape's oracle result) as the last for ``key``; written whole, then
    renamed, so a reader never sees half of it."""
    path = report_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text(json.dumps(report, default=str))
    partial.replace(path)
    return path


def load(key: str) -> dict[str, Any] | None:
    """The last report kept for ``key``; None when there is none or it does not parse."""
    try:
        return json.loads(report_path(key).read_text())
    except (OSError, ValueError):
        return None


def floor_ratios(report: Mapping[str, Any]) -> Iterator[tuple[dict[str, str], float]]:
    """Each bucket's ratio to the floor in a report: its labels (run, kind, bucket) and value."""
    for run, result in report.items():
        if not isinstance(result, Mapping) or "buckets" not in result:
            continue
        for kind, cells in result["buckets"].items():
            for bucket, cell in cells.items():
                if cell.get("ratio") is not None:
                    yield {"run": run, "kind": kind, "bucket": bucket}, float(cell["ratio"])
