"""A trainer process that pushes one model's weights and then exits the ordinary way.

``--how file_system``: shares its tensors as SGLang's ``/update_weights_from_tensor`` payload
(torch's ``file_system`` strategy, which starts a ``torch_shm_manager`` helper) and prints it.
``--how group``: joins the engine's weight-update group as SGLang's trainers do and broadcasts.

Protocol on stdout, one JSON object a line: ``{"payload": ..., "names": ..., ...}`` once the
weights are ready, ``{"helpers": [pid, ...]}`` (this process's children: torch's helpers), then
it waits for a line on stdin (the engine took the push), and exits through the interpreter's
own teardown (atexit, finalizers), as a trainer's job does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from sglang_trainer import broadcast_each, init_group_like_sglang, serialize

from siesta.model.loader import resolve_model


def children() -> list[int]:
    """This process's children, read from /proc (no psutil in the image)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.append(int(entry.name))
    return found


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--how", choices=["file_system", "group"], required=True)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    named = [(n, t.contiguous()) for n, t in resolve_model(args.model).iter_weights(torch.float32)]
    if args.how == "file_system":
        mp.set_sharing_strategy("file_system")
        say(payload=serialize(named))
        say(helpers=children())
        sys.stdin.readline()
        return
    say(names=[n for n, _ in named], shapes=[list(t.shape) for _, t in named])
    group = init_group_like_sglang("127.0.0.1", args.port, 2, "weight_update_group", "gloo", 60.0)
    broadcast_each(group, [t for _, t in named])
    say(helpers=children())
    sys.stdin.readline()


if __name__ == "__main__":
    main()
