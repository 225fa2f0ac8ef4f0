"""After a push the trainer exits, and no helper process of its outlives it because of siesta.

A real trainer process (``exiting_trainer.py``) pushes a whole model into an engine in this
process and exits through the interpreter's own teardown. Its stdout must reach EOF (every
holder of the pipe gone: a job runner waits for exactly that), and every child it had (torch's
``torch_shm_manager`` after a ``file_system`` share) must be gone too. The engine then serves
the pushed weights: its parameters equal the trainer's model, loaded here independently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from siesta import LLM
from siesta.model.loader import resolve_model

TRAINER = Path(__file__).parent / "exiting_trainer.py"
PUSHED = "random:tiny-llama@7"
EXIT_S = 60.0
GONE_S = 10.0


def start(how: str, port: int = 0) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(TRAINER), "--model", PUSHED, "--how", how, "--port", str(port)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def line(proc: subprocess.Popen) -> dict:
    text = proc.stdout.readline()
    assert text, f"the trainer ended early (exit {proc.poll()})"
    return json.loads(text)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's reaping is left


def finish(proc: subprocess.Popen, helpers: list[int]) -> None:
    """Let the trainer exit; its pipe closes and its helpers go, all within bounds."""
    proc.stdin.write("done\n")
    proc.stdin.flush()
    out, _ = proc.communicate(timeout=EXIT_S)  # EOF on stdout: nobody holds the trainer's pipe
    assert proc.returncode == 0, out
    deadline = time.monotonic() + GONE_S
    while any(alive(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in helpers if alive(p)], "a helper of the trainer outlived it"


def assert_serves_pushed(llm: LLM) -> None:
    want = {n: t for n, t in resolve_model(PUSHED).iter_weights(torch.float32)}
    model = llm.engine.runner.model
    for name, tensor in want.items():
        target = model.weight_target(name, model.parameter_table())
        assert target is not None and target.full_shape == tuple(tensor.shape)
    q = llm.engine.runner.model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(q[: want["model.layers.0.self_attn.q_proj.weight"].shape[0]],
                       want["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip


def make() -> LLM:
    return LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 22, max_model_len=256)


def test_a_trainer_that_shared_by_file_system_exits_and_its_shm_manager_goes_with_it():
    llm = make()
    proc = start("file_system")
    try:
        payload = line(proc)["payload"]
        helpers = line(proc)["helpers"]
        assert helpers, "torch's file_system sharing starts a torch_shm_manager"
        result = llm.engine.update_weights_from_tensor([payload])
        assert result.weight_version == "1" and result.missing_tensors == 0
        finish(proc, helpers)
    finally:
        proc.kill()
    assert_serves_pushed(llm)


def test_a_trainer_that_broadcast_over_a_group_exits_while_the_engine_keeps_the_group():
    from e2e.servers import free_port

    llm = make()
    port = free_port()
    proc = start("group", port)
    try:
        declared = line(proc)
        llm.engine.init_weights_update_group(
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
             "group_name": "weight_update_group", "backend": "gloo"})  # fmt: skip
        dtypes = ["float32"] * len(declared["names"])
        result = llm.engine.update_weights_from_distributed(declared["names"], dtypes, declared["shapes"])
        assert result.missing_tensors == 0
        finish(proc, line(proc)["helpers"])
    finally:
        proc.kill()
    assert_serves_pushed(llm)
