"""A real RL loop: a transformers trainer and a served siesta that time-share the machine.

The trainer (this process) holds SmolLM2-135M-Instruct in fp32 through transformers, with
AdamW. ``siesta serve`` runs in another process, with the KV tier on. Each iteration:

1. rollouts: a group of samples per task over HTTP (token-id prompts, temperature 1,
   ``logprobs`` of the sampled tokens and ``return_token_ids``);
2. a verifiable reward: the task is to continue an arithmetic sequence ("Continue the
   sequence: 7, 10, 13, 16, 19,"); a sample scores 1 when the first number it writes is the
   next term. The base model gets it right about half the time, so rewards vary in a group;
3. some long samples are paused half-way across a sleep that keeps the weights
   (``sleep(level=1, mode="keep", clear_connector_cache=False)``, ``wake_up()``); they resume
   by loading their KV from the tier;
4. the engine sleeps (level 2), the trainer takes one GRPO-style step (group-normalised
   advantages; loss = -mean(advantage * sum of the sampled tokens' logprobs, recomputed by
   the trainer));
5. ``wake_up(tags=["weights"])``, the weights travel with ``WeightSender(client, "nccl")``
   (gloo on the CPU), ``wake_up(tags=["kv_cache"])``.

Every rollout checks that the engine's logprobs of what it sampled are the trainer's own
under the same weights (the ones just pushed), that no request is served KV of older
weights (0 cached tokens for the first sample of each task after a push, and no tier hit),
and that the paused samples did load their KV from the tier. After the last step a final
rollout checks the last push. Run (CPU, a few minutes)::

    python examples/rl_loop.py                      # starts its own server
    python examples/rl_loop.py --url http://127.0.0.1:8000 --iterations 8
        # a server started with: siesta serve --dev-mode --dtype float32 \\
        #   --weight-transfer-config '{"backend":"nccl"}' --kv-transfer-config '<offloading JSON>'

``run(...)`` returns one record per rollout round; ``tests/e2e/test_rl_loop.py`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from siesta.client import SiestaClient
from siesta.tokenizer import encode

# -- configuration ---------------------------------------------------------------------------

MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 256 << 20
TIER_BYTES = 1 << 30
BLOCK_SIZE = 16
OFFLOAD_CONFIG = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"block_size": BLOCK_SIZE, "cpu_bytes_to_use": TIER_BYTES}}  # fmt: skip
WEIGHT_TRANSFER_CONFIG = {"backend": "nccl"}  # gloo on the CPU
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.02

EXTERNAL_HITS = "siesta_external_prefix_cache_hits_total"
DEVICE_HITS = "siesta_prefix_cache_hits_total"
HOST_TIER_BYTES = 'siesta_kv_offload_bytes_used{tier="host"}'


@dataclass
class LoopConfig:
    tasks: int = 4  # prompts per rollout
    group_size: int = 4  # samples per prompt (GRPO's group)
    max_tokens: int = 6  # a rollout's answer: one number, then whatever follows
    paused_samples: int = 2  # long samples paused across a keep sleep each iteration
    paused_max_tokens: int = 64
    pause_after_tokens: int = 16  # each long sample has streamed this many before the sleep
    lr: float = 2e-5
    max_grad_norm: float = 1.0
    seed: int = 0
    trainer_threads: int | None = None  # torch's default (every core) unless set


# -- the task and its reward -----------------------------------------------------------------


@dataclass
class Task:
    prompt: str
    ids: list[int]
    answer: int


def make_tasks(tokenizer, count: int, seed: int = 0) -> list[Task]:
    """Arithmetic sequences to continue; each starts differently, so no two share a KV block."""
    rng = random.Random(seed)
    tasks, starts = [], set()
    while len(tasks) < count:
        start, step, terms = rng.randint(1, 40), rng.randint(2, 6), rng.randint(5, 8)
        if start in starts:
            continue
        starts.add(start)
        seq = [start + step * k for k in range(terms)]
        prompt = "Continue the sequence: " + ", ".join(map(str, seq)) + ","
        tasks.append(Task(prompt, encode(tokenizer, prompt), start + step * terms))
    return tasks


_NUMBER = re.compile(r"-?\d+")


def reward(task: Task, text: str) -> float:
    """1 if the first number of the completion is the sequence's next term."""
    match = _NUMBER.search(text)
    return float(match is not None and int(match.group()) == task.answer)


# -- the server ------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags() -> list[str]:
    """``siesta serve``'s flags for the loop: dev mode, fp32, the KV tier, weight transfer."""
    return ["--dev-mode", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-bytes", str(KV_CACHE_BYTES), "--kv-transfer-config", json.dumps(OFFLOAD_CONFIG),
            "--weight-transfer-config", json.dumps(WEIGHT_TRANSFER_CONFIG)]  # fmt: skip


def start_server(threads: int | None = None) -> ServerProcess:
    """``siesta serve`` with ``server_flags()`` on a free loopback port (``wait_healthy`` next)."""
    port = _free_port()
    log_path = Path(tempfile.mkdtemp(prefix="siesta-rl-")) / "server.log"
    cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", "--port", str(port), *server_flags()]
    # The trainer sleeps while the engine generates and the other way round, but both
    # processes' thread pools exist all along: half the cores each keeps them from fighting.
    threads = threads or max(1, (os.cpu_count() or 2) // 2)
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(f"http://127.0.0.1:{port}", process, log_path)


def wait_healthy(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"siesta serve exited with {server.process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"siesta serve was not healthy within {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")


# -- the trainer -----------------------------------------------------------------------------


def load_trainer_model() -> torch.nn.Module:
    """The embedded SmolLM2 as a transformers model in fp32, its tensors read from the GGUF by
    siesta's loader: the same tensors transformers' own GGUF loader gives
    (tests/model/test_loader.py), in 9 s instead of about 50 on two cores."""
    from transformers import AutoModelForCausalLM

    from siesta.model.loader import resolve_model

    source = resolve_model(None)
    model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32)
    result = model.load_state_dict(dict(source.iter_weights(torch.float32, "cpu")), strict=False)
    missing = [k for k in result.missing_keys if not (model.config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"the trainer did not take the checkpoint: missing {missing}, extra {result.unexpected_keys}")
    model.tie_weights()
    return model.eval()  # no dropout: the trainer's logprobs are the engine's


def load_tokenizer():
    """The served model's tokenizer (siesta caches it; transformers rebuilds it from GGUF slowly)."""
    from siesta.model.loader import resolve_model

    return resolve_model(None).load_tokenizer()


def token_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]
) -> list[torch.Tensor]:
    """Each completion's per-token logprobs under ``model`` (one right-padded batch).

    Only the completion positions go through the LM head.
    """
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    width = max(lengths)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, : lengths[i]] = torch.tensor(p + c)
        mask[i, : lengths[i]] = 1
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    rows, cols, targets = [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rows += [i] * len(c)
        cols += range(len(p) - 1, len(p) + len(c) - 1)  # the position that predicts each token
        targets += c
    logits = model.lm_head(hidden[rows, cols]).float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
    return list(picked.split([len(c) for c in completions]))


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
    """GRPO's: each reward minus its group's mean, over the group's std (0 for a flat group)."""
    out = []
    for g in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[g : g + group_size])
        std = group.std(unbiased=False)
        adv = (group - group.mean()) / std if std > 0 else torch.zeros_like(group)
        out += adv.tolist()
    return out


def max_abs_diff(ours: list[torch.Tensor], theirs: list[list[float]]) -> float:
    diffs = [(a.detach() - torch.tensor(b, dtype=a.dtype)).abs().max().item() for a, b in zip(ours, theirs) if b]
    return max(diffs, default=0.0)


# -- the engine side -------------------------------------------------------------------------


@dataclass
class Sample:
    task: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    reward: float = 0.0


def _metric(client: SiestaClient, name: str) -> float:
    return client.metrics().get(name, 0.0)


def rollout(client: SiestaClient, tasks: list[Task], cfg: LoopConfig, seed: int) -> tuple[list[Sample], dict[str, Any]]:
    """One request: every task, ``group_size`` samples each; returns them and what the cache did."""
    before = client.metrics()
    body = {"n": cfg.group_size, "max_tokens": cfg.max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "logprobs": 0, "return_token_ids": True, "seed": seed}  # fmt: skip
    out = client.completions([t.ids for t in tasks], **body)
    after = client.metrics()
    samples = []
    for choice in sorted(out["choices"], key=lambda c: c["index"]):
        task = choice["index"] // cfg.group_size
        if choice["prompt_token_ids"] != tasks[task].ids:
            raise AssertionError(f"choice {choice['index']} came back with another prompt")
        sample = Sample(task, choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"],
                        choice["text"])  # fmt: skip
        sample.reward = reward(tasks[task], sample.text)
        samples.append(sample)
    cache = {
        # Each task's first sample only (usage counts a prompt's cache hits once).
        "first_sample_cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
        "tier_hits": after.get(EXTERNAL_HITS, 0.0) - before.get(EXTERNAL_HITS, 0.0),
        "device_hits": after.get(DEVICE_HITS, 0.0) - before.get(DEVICE_HITS, 0.0),
    }
    return samples, cache


def same_version_hit(client: SiestaClient, task: Task) -> int:
    """A task sent again under the same weights: its cached tokens (the check that hits can happen)."""
    out = client.completions(task.ids, max_tokens=1, temperature=0.0)
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


class _LongSample(threading.Thread):
    """A long sample streamed in the background, keeping its ids and logprobs as they arrive."""

    def __init__(self, url: str, task: Task, cfg: LoopConfig, seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.task, self.cfg, self.seed = url, task, cfg, seed
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with SiestaClient(self.url) as client:
                for chunk in client.stream_completions(
                    self.task.ids, max_tokens=self.cfg.paused_max_tokens, ignore_eos=True, temperature=1.0,
                    logprobs=0, return_token_ids=True, seed=self.seed,
                ):  # fmt: skip
                    for choice in chunk.get("choices", []):
                        self.token_ids += choice["token_ids"]
                        self.logprobs += choice["logprobs"]["token_logprobs"] if choice["logprobs"] else []
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e


def paused_across_keep_sleep(client: SiestaClient, url: str, tasks: list[Task], cfg: LoopConfig, seed: int
                             ) -> tuple[list[_LongSample], dict[str, Any]]:  # fmt: skip
    """Long samples, paused half-way by a sleep that keeps weights and tier, then resumed."""
    longs = [_LongSample(url, tasks[i % len(tasks)], cfg, seed + i) for i in range(cfg.paused_samples)]
    for s in longs:
        s.start()
    deadline = time.monotonic() + 120.0
    while any(len(s.token_ids) < cfg.pause_after_tokens for s in longs):
        if time.monotonic() > deadline or any(s.error or not s.is_alive() for s in longs):
            raise RuntimeError(f"long samples did not start: {[s.error for s in longs]}")
        time.sleep(POLL_S)
    hits_before = _metric(client, EXTERNAL_HITS)
    client.sleep(level=1, mode="keep", clear_connector_cache=False)
    tokens_at_sleep = [len(s.token_ids) for s in longs]
    client.wake_up()
    for s in longs:
        s.join(300.0)
        if s.is_alive() or s.error is not None:
            raise RuntimeError(f"a paused sample did not finish: {s.error}")
    info = {
        "tokens_at_sleep": tokens_at_sleep,
        "tokens": [len(s.token_ids) for s in longs],
        "finish_reasons": [s.finish_reason for s in longs],
        "tier_hits": _metric(client, EXTERNAL_HITS) - hits_before,
    }
    return longs, info


# -- the loop --------------------------------------------------------------------------------


def run(iterations: int = 3, url: str | None = None, cfg: LoopConfig | None = None,
        model: torch.nn.Module | None = None, log=print) -> list[dict[str, Any]]:  # fmt: skip
    """``iterations`` training steps, then a final rollout; one record per rollout round.

    ``url``: a server started with ``server_flags()`` (default: start one, stopped at the
    end). ``model``: the trainer's model if already loaded (``load_trainer_model()``).

    A record: its rewards and their mean, the weight version it sampled under, the largest
    |engine - trainer| logprob of its samples, what the cache served its first samples, and
    (training rounds) the paused samples' resume and the version pushed after the step.
    """
    cfg = cfg or LoopConfig()
    threads = torch.get_num_threads()
    if cfg.trainer_threads:
        torch.set_num_threads(cfg.trainer_threads)
    server = start_server() if url is None else None
    try:
        model = model or load_trainer_model()  # while the server starts
        if server is not None:
            wait_healthy(server)
        return _run(iterations, url or server.url, cfg, model, log)
    finally:
        torch.set_num_threads(threads)
        if server is not None:
            server.stop()


def _run(iterations: int, base_url: str, cfg: LoopConfig, model: torch.nn.Module, log) -> list[dict[str, Any]]:
    torch.manual_seed(cfg.seed)
    tasks = make_tasks(load_tokenizer(), cfg.tasks, cfg.seed)
    # A pure policy-gradient step: no weight decay. fused: one kernel over each tensor (CPU too).
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
    records: list[dict[str, Any]] = []
    with SiestaClient(base_url) as client:
        from siesta.weight_transfer import WeightSender

        sender = WeightSender(client, "nccl")
        sender.init()
        try:
            version = client.weight_version()
            for round_ in range(iterations + 1):
                train = round_ < iterations
                t0 = time.monotonic()
                samples, cache = rollout(client, tasks, cfg, seed=cfg.seed + 1000 * round_)
                record: dict[str, Any] = {
                    "iteration": round_,
                    "weight_version": str(version),
                    "engine_weight_version": str(client.weight_version()),
                    "rewards": [s.reward for s in samples],
                    "reward_mean": sum(s.reward for s in samples) / len(samples),
                    **cache,
                    "rollout_s": time.monotonic() - t0,
                }
                record["same_version_cached_tokens"] = same_version_hit(client, tasks[0])
                longs: list[_LongSample] = []
                if train and cfg.paused_samples:
                    longs, record["paused"] = paused_across_keep_sleep(client, base_url, tasks, cfg, cfg.seed + round_)

                # The trainer's turn: the engine hands the machine over (its tier kept, so
                # entries of these weights are still there when the new ones arrive). The
                # final round only checks the last push.
                t1 = time.monotonic()
                if train:
                    client.sleep(level=2, clear_connector_cache=False)
                with torch.enable_grad() if train else torch.no_grad():
                    ours = token_logprobs(model, [s.prompt_ids for s in samples], [s.token_ids for s in samples])
                record["logprob_max_abs_diff"] = max_abs_diff(ours, [s.logprobs for s in samples])
                if longs:
                    with torch.no_grad():
                        resumed = token_logprobs(model, [s.task.ids for s in longs], [s.token_ids for s in longs])
                    record["paused"]["logprob_max_abs_diff"] = max_abs_diff(resumed, [s.logprobs for s in longs])
                if train:
                    advantages = group_advantages(record["rewards"], cfg.group_size)
                    loss = -torch.stack([a * lp.sum() for a, lp in zip(advantages, ours)]).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    record["loss"] = loss.item()
                    # How far the step moved these logprobs: what a push that did not land would
                    # leave between the engine and the trainer (the check above must see it).
                    with torch.no_grad():
                        moved = token_logprobs(model, [s.prompt_ids for s in samples], [s.token_ids for s in samples])
                    record["step_logprob_change"] = max_abs_diff(moved, [lp.tolist() for lp in ours])
                record["train_s"] = time.monotonic() - t1
                del ours

                t2 = time.monotonic()
                if train:
                    # KV of the weights being replaced, still in the tier while they travel.
                    record["tier_bytes_before_push"] = _metric(client, HOST_TIER_BYTES)
                    client.wake_up(tags=["weights"])
                    version = sender.push(model)
                    record["pushed_version"] = str(version)
                    client.wake_up(tags=["kv_cache"])
                record["push_s"] = time.monotonic() - t2
                records.append(record)
                log(_summary(record))
        finally:
            sender.close()
    return records


def _summary(r: dict[str, Any]) -> str:
    line = (f"iter {r['iteration']}  weights v{r['weight_version']}  reward {r['reward_mean']:.3f}  "
            f"logprob |engine-trainer| max {r['logprob_max_abs_diff']:.2e}  "
            f"first-sample cached {r['first_sample_cached_tokens']}  tier hits {r['tier_hits']:.0f}")  # fmt: skip
    if "paused" in r:
        p = r["paused"]
        line += (f"  paused at {p['tokens_at_sleep']} -> {p['tokens']} tokens, tier hits {p['tier_hits']:.0f}, "
                 f"resumed logprob diff {p['logprob_max_abs_diff']:.2e}")  # fmt: skip
    if "pushed_version" in r:
        held_mb = r["tier_bytes_before_push"] / 1e6
        line += (f"  loss {r['loss']:+.4f}  step moved logprobs by {r['step_logprob_change']:.2f}  "
                 f"pushed v{r['pushed_version']} (tier held {held_mb:.1f} MB)")  # fmt: skip
    line += f"  ({r['rollout_s']:.1f}s rollout, {r['train_s']:.1f}s train, {r['push_s']:.1f}s push)"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--tasks", type=int, default=LoopConfig.tasks)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=LoopConfig.lr)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trainer-threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args()
    cfg = LoopConfig(tasks=args.tasks, group_size=args.group_size, lr=args.lr, seed=args.seed,
                     trainer_threads=args.trainer_threads)
    records = run(args.iterations, args.url, cfg)
    print("reward per iteration:", " ".join(f"{r['reward_mean']:.3f}" for r in records))
    print("max |engine - trainer| logprob:", f"{max(r['logprob_max_abs_diff'] for r in records):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
