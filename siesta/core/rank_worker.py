"""A tensor-parallel rank other than 0, in its own process: its shard of the model, then the
calls rank 0 sends until it says stop.

A step (``launch``) is not answered: its collectives keep the ranks in step, and a rank that
fails one has failed for good (it reports why and exits; rank 0 names it). Other calls answer
with their result or a ``RankError``, and the rank goes on.
"""

from __future__ import annotations

import logging

import torch

from siesta.config import EngineConfig
from siesta.core.model_runner import ModelRunner
from siesta.core.rank_ops import RankError, RankOps
from siesta.distributed import group as rank_group
from siesta.distributed.channel import STOP, RankChannel
from siesta.model.loader import resolve_model

logger = logging.getLogger(__name__)


def serve_rank(channel: RankChannel, rank: int, size: int, config: EngineConfig, port: int, max_model_len: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank-{rank} %(levelname)s %(name)s: %(message)s")
    config = config.for_rank(rank)
    device = config.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    membership = rank_group.join(rank, size, device, config.parallel.rank_timeout_s, port=port)
    source = resolve_model(config.model.model, config.model.seed, config.model.tokenizer)
    runner = ModelRunner(config, source, max_model_len, tp=membership.tp)
    ops = RankOps(runner, source, local_rank=rank, notes=channel.note)
    channel.ready({"num_blocks": runner.num_blocks})
    try:
        _serve(channel, ops)
    finally:
        ops.close()


def _serve(channel: RankChannel, ops: RankOps) -> None:
    while True:
        call = channel.receive()
        if call.op == STOP:
            return
        if not call.reply:
            getattr(ops, call.op)(*call.args, **call.kwargs)  # a failure here is fatal: see the module doc
            continue
        try:
            value, ok = getattr(ops, call.op)(*call.args, **call.kwargs), True
        except Exception as e:
            logger.exception("%s failed", call.op)
            value, ok = RankError.of(e), False
        channel.answer(call, ok, value)
