"""What the framework modules share: the trainer process's client, the oracle check, HTTP helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

# bench/gpu.sh runs the colocated paths (CUDA IPC) with the trainer's tensors on the GPU.
ON_GPU = os.environ.get("SIESTA_TRAINER_DEVICE", "cpu").startswith("cuda")
TRAINER = Path(__file__).with_name("trainer.py")
TRAINER_CALL_S = 180.0
# Logprobs against the trainer's, fp32 both sides (the engine's fp32 attention is exact on a GPU too).
TOLERANCE = 1e-4
FEW_TOKENS_S = 0.05  # the tiny model samples ~20 tokens meanwhile on the 2-core machine
# A request that a pause or an abort must meet mid-generation: the whole context the server takes
# (``MAX_MODEL_LEN``), ~5 s of decoding on the 2-core machine, so a loaded machine's stall between
# "it runs" and the abort cannot let it finish first (480 tokens, ~1 s, once did).
MAX_MODEL_LEN = 2048  # tiny-llama's max_position_embeddings
LONG_TOKENS = MAX_MODEL_LEN - 48  # room for the longest prompt a framework module sends


class TrainerProcess:
    """The trainer, a process of its own; each call is one op of ``trainer.Trainer``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(TRAINER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)  # fmt: skip
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def __call__(self, op: str, **kwargs: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the trainer exited ({self.proc.poll()})"
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply["result"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def check_against_trainer(trainer: TrainerProcess, prompt: list[int], tokens: list[int], logprobs: list[float],
                          **sampling: Any) -> dict[str, Any]:  # fmt: skip
    """The engine's logprobs of the tokens it sampled are the trainer's, to TOLERANCE."""
    assert tokens, "nothing was generated"
    want = trainer("score", prompt=prompt, tokens=tokens, **sampling)
    worst = max(abs(a - b) for a, b in zip(logprobs, want["logprobs"]))
    assert worst <= TOLERANCE, f"logprobs differ from the trainer's by {worst:.2e}"
    return want


def get(url: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(url + path, params=params, timeout=TRAINER_CALL_S)


def post(url: str, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TRAINER_CALL_S, **kwargs)


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json() if response.content else None


def in_flight(url: str, call) -> tuple[threading.Thread, dict[str, Any]]:
    """``call()`` on a thread, returned once the engine runs it and has sampled a few tokens
    (SGLang's /v1/loads counts it), so a pause or an abort meets it mid-generation."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(out=call()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not box:
        load = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=TRAINER_CALL_S).json()
        if load["aggregate"]["total_running_reqs"] > 0:
            time.sleep(FEW_TOKENS_S)
            return thread, box
        time.sleep(0.01)
    raise AssertionError("the request never ran")
