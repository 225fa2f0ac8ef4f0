"""The seed's serve line exactly as the seed gives it (minus ``--tensor-parallel-size``), with
the seed's client unchanged: what a vLLM user who pastes that line gets from siesta.

The seed serves a DeepSeek checkpoint, whose compressed KV takes 1.31 GB for the client's
311k tokens; here ``$MODEL`` is random weights of a trainer's architecture with SmolLM2's
tokenizer, as ``random:DIR`` (a folder holding that config.json and the tokenizer files), so no
flag is added to the line. Whether the burst's KV fits the line's 32 GiB tier decides the kept
replay: Qwen2.5-7B's (4 KV heads, 56 KiB a token) does; Llama-3-8B's (128 KiB a token, 37 GiB
for the burst) does not, and its replay recomputes what the tier could not keep. The server's steps are traced
(``SIESTA_STEP_TRACE``, an environment variable, not a flag): the kept replay's steps say how
much it computed besides loading, which is what the step budget can change.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from siesta.bench.resume_http import DEFAULT_TOKENIZER, ServerProcess, run_seed_client
from siesta.config import STEP_TRACE_ENV
from siesta.model.random_init import RANDOM_PREFIX, RANDOM_SHAPES

SEED_PORT = 8712
# The seed's command, flag for flag, after ``vllm serve $MODEL``.
SEED_FLAGS = [
    "--served-model-name", "dsv41", "--enable-prefix-caching", "--max-model-len", "65536",
    "--gpu-memory-utilization", "0.85", "--port", str(SEED_PORT),
    "--kv-transfer-config",
    ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
     '"kv_connector_extra_config":{"block_size":128,"cpu_bytes_to_use":34359738368}}'),
]  # fmt: skip
SEED_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# The diagnostic arm's environment: the same line with vLLM's batch-invariant switch. Blocks the
# kept replay stores are blocks of decoded tokens whose greedy picks differ from the first burst's
# (random weights leave near-ties that a batch's other rows can flip); batch-invariant numerics
# make the replay pick what the first burst picked, so then it stores nothing.
INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}
INVARIANT_ENV_LABEL = "VLLM_BATCH_INVARIANT=1"
# The line's host tier (its cpu_bytes_to_use): 32 GiB.
SEED_TIER_BYTES = json.loads(SEED_FLAGS[SEED_FLAGS.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
    "cpu_bytes_to_use"]
# A pause this long between steps separates the client's bursts (sleep and wake-up among them).
BURST_GAP_S = 0.3


@dataclass
class SeedLine:
    """``siesta serve $MODEL <the seed's flags>``; ``extra_flags`` only for CPU test runs."""

    model: str
    extra_flags: list[str] = field(default_factory=list)
    port: int = SEED_PORT

    def command(self, port: int) -> list[str]:
        flags = [f if f != str(SEED_PORT) else str(port) for f in SEED_FLAGS]
        return [sys.executable, "-m", "siesta.entrypoints.cli", "serve", self.model, *flags, *self.extra_flags]


def model_folder(shape: str, tokenizer: str | Path, into: Path) -> str:
    """``random:DIR`` for ``shape``'s config.json beside ``tokenizer``'s files."""
    RANDOM_SHAPES[shape].config().save_pretrained(into)
    for item in Path(tokenizer).iterdir():
        if item.is_file():
            shutil.copy(item, into / item.name)
    return f"{RANDOM_PREFIX}{into}"


def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def last_burst(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps after the last idle gap (the kept replay, the client's last burst), summed."""
    start = 0
    for i in range(1, len(steps)):
        if steps[i]["start_s"] - steps[i - 1]["end_s"] > BURST_GAP_S:
            start = i
    burst = steps[start:]
    if not burst:
        return {"steps": 0}
    return {
        "steps": len(burst),
        "seconds": round(burst[-1]["end_s"] - burst[0]["start_s"], 4),
        "tokens": sum(s["tokens"] for s in burst),
        "prefill_tokens": sum(s["tokens"] - s["decode_rows"] for s in burst),
        "steps_with_prefill": sum(1 for s in burst if s["prefill_rows"]),
        "max_step_s": round(max(s["end_s"] - s["start_s"] for s in burst), 4),
        "max_loading": max(s["loading"] for s in burst),
    }


def kv_bytes_per_token(shape: str) -> int:
    """K and V of every layer for one token in bf16 (the line serves the checkpoint's dtype)."""
    from siesta.model.registry import shape_of

    s = shape_of(RANDOM_SHAPES[shape].config())
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2


def measure(line: SeedLine, requests: int, prompt_words: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start the seed's server, run the seed's client, stop: its JSON and the kept replay's steps."""
    env = SEED_ENV | (env or {})
    with tempfile.TemporaryDirectory(prefix="siesta-seed-line-") as tmp:
        trace = Path(tmp) / "steps.jsonl"
        with ServerProcess(line, env=env | {STEP_TRACE_ENV: str(trace)}) as server:
            try:
                seed = run_seed_client(server.url, requests, prompt_words)
            except BaseException:
                print(server.log_tail(), file=sys.stderr)
                raise
        kept_steps = last_burst(read_trace(trace))
    speedup = seed["cleared"]["replay_p50_s"] / seed["kept"]["replay_p50_s"]
    stored = {k: v for k, v in seed["kept"]["metric_delta"].items() if "store_bytes" in k}
    return {"seed_client": seed, "speedup_p50": speedup, "kept_store_bytes": stored, "kept_replay_steps": kept_steps,
            "server_startup_s": server.startup_s, "command": line.command(server.port), "env": env}  # fmt: skip


def run(requests: int, prompt_words: int, shape: str = "llama-3-8b", tokenizer: str | Path = DEFAULT_TOKENIZER,
        extra_flags: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    from siesta.bench.resume_http import seed_prompt_tokens

    with tempfile.TemporaryDirectory(prefix="siesta-seed-model-") as folder:
        line = SeedLine(model_folder(shape, tokenizer, Path(folder)), extra_flags or [])
        out = measure(line, requests, prompt_words, env)
    burst = requests * seed_prompt_tokens(str(tokenizer), prompt_words) * kv_bytes_per_token(shape)
    out["burst_kv"] = {"GiB": burst / 2**30, "tier_GiB": SEED_TIER_BYTES / 2**30, "fits": burst <= SEED_TIER_BYTES,
                       "bytes_per_token": kv_bytes_per_token(shape)}  # fmt: skip
    return out
