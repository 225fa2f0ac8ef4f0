"""What one tensor-parallel rank does besides stepping: the same calls on every rank.

Rank 0 runs them on its own runner through ``siesta.core.ranks`` while the other ranks run
them in their processes (``siesta.core.rank_worker``), so each call is written once. Each rank
owns its shard: its weights, its KV cache, its sleep memory and its weight updater (which
writes this rank's slice of each full tensor a trainer sends).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from siesta.core.device_memory import ArenaMemory, MemoryReport, SleepableMemory
from siesta.core.model_runner import ModelRunner, StepPlan
from siesta.core.tier_ranks import NOTE, SharedBuffer
from siesta.model.loader import ModelSource, resolve_model
from siesta.tiers.copy_feeder import CopyFeeder
from siesta.tiers.transfer import BlockCopier
from siesta.weight_transfer.pickled_tensors import SerializedTensors
from siesta.weight_transfer.receivers import LocalReceiver
from siesta.weight_transfer.sglang_group import SglangRendezvous, parse_sglang_group
from siesta.weight_transfer.sglang_updates import tensor_update_info
from siesta.weight_transfer.updater import UpdateFailed, WeightUpdater
from siesta.weight_transfer.wire import WeightTransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankError:
    """A call that failed on a rank, as it crosses back to rank 0 (exceptions of siesta's own
    types do not all pickle)."""

    kind: str  # "refused" (nothing written), "broke_off" (an update stopped part way) or "error"
    message: str
    unwritten: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, e: BaseException) -> RankError:
        if isinstance(e, UpdateFailed):
            return cls("broke_off", str(e), frozenset(e.unwritten or ()))
        if isinstance(e, WeightTransferError):
            return cls("refused", str(e))
        return cls("error", f"{type(e).__name__}: {e}")


class RankOps:
    """One rank's runner, memory and updater, and the calls rank 0 makes on every rank."""

    def __init__(self, runner: ModelRunner, source: ModelSource, local_rank: int,
                 notes: Callable[[str, Any], None] | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.source = source
        self.rank = local_rank
        self.memory: SleepableMemory | ArenaMemory = runner.sleepable_memory()
        self.updater = WeightUpdater(runner.config.weight_transfer, runner.model, runner.device, local_rank)
        self.tiers = RankTierCopies(runner, local_rank, notes) if notes is not None else None
        self._serialized: SerializedTensors | None = None  # SGLang's tensors, decoded here

    # -- steps ---------------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> None:
        self.runner.run_plan(plan)

    # -- sleep ---------------------------------------------------------------------------

    def free_device_bytes(self) -> int:
        """This rank's free device memory (its host memory on the CPU: nothing to report)."""
        if self.runner.device.type != "cuda":
            return 0
        return torch.cuda.mem_get_info(self.runner.device)[0]

    def release_kv_cache(self) -> MemoryReport:
        return self.memory.release_kv_cache()

    def release_weights(self, backup: bool) -> MemoryReport:
        return self.memory.release_weights(backup=backup)

    def restore_weights(self) -> tuple[MemoryReport, bool]:
        return self.memory.restore_weights()

    def restore_kv_cache(self) -> MemoryReport:
        return self.memory.restore_kv_cache()

    def memory_moved(self) -> None:
        self.runner.memory_moved()

    def recapture_graphs(self) -> None:
        self.runner.recapture_graphs()

    # -- weights -------------------------------------------------------------------------

    def reload_weights(self) -> None:
        self.runner.load_weights(
            self.runner.model, self.source.iter_weights(self.runner.dtype, self.runner.device), complete=True
        )

    def init_engine(self, init_info: Any) -> None:
        self.updater.init_engine(init_info)

    def start_update(self) -> bool:
        return self.updater.start()

    def receive(self, update_info: Any) -> int:
        return self.updater.receive(update_info)

    def write(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.updater.write(weights)

    def write_path(self, path: str) -> None:
        self.updater.write(resolve_model(path).iter_weights(self.runner.dtype, self.runner.device))

    def close_update(self) -> None:
        self.updater.state.close()

    # SGLang's one-call updates: each rank joins the trainer's group as rank_offset + its rank,
    # and takes its own entry of serialized_named_tensors.

    def join_sglang_group(self, init_info: Any) -> str:
        info = parse_sglang_group(init_info)
        self.updater.join_group(info.group_name, init_info, SglangRendezvous())
        return info.group_name

    # Joins run on a thread of each rank (weight_transfer/joining.py): begun on every rank,
    # polled on rank 0, finished on every rank once rank 0's has ended.

    def begin_join_group(self, init_info: Any) -> str:
        info = parse_sglang_group(init_info)
        self.updater.begin_join(info.group_name, init_info, SglangRendezvous())
        return info.group_name

    def begin_init_engine(self, init_info: Any) -> None:
        self.updater.begin_join(None, init_info, self.updater.receiver.rendezvous)

    def finish_join(self, name: str | None) -> None:
        self.updater.finish_join(name)

    def leave_group(self, name: str) -> bool:
        return self.updater.leave_group(name)

    def receive_in_group(self, name: str, update_info: Any) -> int:
        receiver = self.updater.groups.get(name)
        if receiver is None:
            raise WeightTransferError(f"no weight update group {name!r} on rank {self.rank}")
        return self.updater.receive(update_info, receiver)

    def close_group(self, name: str) -> None:
        receiver = self.updater.groups.get(name)
        if receiver is not None:
            receiver.close()

    def receive_serialized(self, serialized: list[Any], load_format: str | None) -> int:
        if self._serialized is None:
            self._serialized = SerializedTensors(self.runner.device)
        info, tensors = tensor_update_info(self._serialized.decode(serialized[self.rank], load_format))
        receiver = LocalReceiver(self.runner.config.weight_transfer, self.runner.device, tensors)
        return self.updater.receive(info, receiver)

    # -- the KV tiers (rank 0's connector decides; this rank copies its part) -------------

    def map_tier_buffer(self, shared: SharedBuffer) -> None:
        self.tiers.map(shared)

    def open_tier_copies(self, name: str, path: str, direction: str, window_bytes: int, rank_stride: int) -> None:
        self.tiers.open(name, path, direction, window_bytes, rank_stride)

    def tier_copy(self, name: str, tag: int, offsets: list[tuple[int, int, list[int]]]) -> None:
        self.tiers.copy(name, tag, offsets)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
        self.updater.close()


# How often a rank looks for tier copies that landed, to tell rank 0.
TIER_POLL_S = 0.001


class RankTierCopies:
    """This rank's part of the tiers' copies: rank 0's jobs, made between this rank's device
    blocks and its part of the shared slots; a thread tells rank 0 which landed."""

    def __init__(self, runner: ModelRunner, rank: int, notes: Callable[[str, Any], None]) -> None:
        self.runner = runner
        self.rank = rank
        self.notes = notes
        self.copier = BlockCopier(runner.device)
        self.buffers: dict[str, torch.Tensor] = {}  # path -> flat bytes
        self.feeders: dict[str, tuple[CopyFeeder, str, int]] = {}  # name -> (feeder, path, rank stride)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def map(self, shared: SharedBuffer) -> None:
        self.buffers[shared.path] = shared.map(self.runner.device).view(-1).view(torch.uint8)

    def open(self, name: str, path: str, direction: str, window_bytes: int, rank_stride: int) -> None:
        kv = self.runner.kv_cache
        threaded = self.copier.cuda and direction == "in"  # as rank 0's connector runs them
        feeder = CopyFeeder(self.copier, direction, window_bytes, kv.block_bytes, threaded=threaded)
        self.feeders[name] = (feeder, path, rank_stride)
        if self._thread is None:
            self._thread = threading.Thread(target=self._report, name="rank-tier-copies", daemon=True)
            self._thread.start()

    def copy(self, name: str, tag: int, offsets: list[tuple[int, int, list[int]]]) -> None:
        feeder, path, stride = self.feeders[name]
        kv = self.runner.kv_cache
        flat, block_bytes = self.buffers[path], kv.block_bytes
        parts = []
        for offset, count, block_ids in offsets:
            start = offset + self.rank * stride
            view = flat[start : start + count * block_bytes].view(kv.tensor.dtype).view(count, *kv.tensor.shape[1:])
            parts.append((view, block_ids))
        # After every forward this rank queued so far: the calls come in rank 0's order.
        feeder.submit(tag, parts, kv)

    def _report(self) -> None:
        try:
            while not self._stop.wait(TIER_POLL_S):
                for name, (feeder, _, _) in list(self.feeders.items()):
                    tags = feeder.landed()  # raises if this rank's copies failed
                    if tags:
                        self.notes(NOTE, (name, tags))
        except BaseException:  # rank 0 sees the process go and names this rank
            logger.exception("tier copies failed on rank %d", self.rank)
            os._exit(1)

    def close(self) -> None:
        self._stop.set()
