"""Trainer processes that misbehave on purpose: they send part of an update, then die or go silent.

Each is rank 0 of a real gloo group (``siesta.weight_transfer.group``), started with
``python -m`` so that it is a separate process whose sockets close when it dies.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from siesta.weight_transfer.group import SOURCE_RANK, open_group

SILENT_S = 600.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=["die-after", "hang-after"], required=True)
    ap.add_argument("--nbytes", type=int, default=0, help="bytes to broadcast first (0: none)")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    print("starting", flush=True)  # the store binds at once: the engine may connect now
    group = open_group("127.0.0.1", args.port, SOURCE_RANK, 2, torch.device("cpu"), args.timeout_s)
    print("joined", flush=True)
    if args.nbytes:
        group.broadcast(torch.zeros(args.nbytes, dtype=torch.uint8))
    print("sent", flush=True)
    if args.mode == "hang-after":
        time.sleep(SILENT_S)
        return
    sys.stdout.flush()
    os._exit(1)  # dies with the rest of the update unsent


if __name__ == "__main__":
    main()
