"""What one tensor-parallel rank does besides stepping: the same calls on every rank.

Rank 0 runs them on its own runner through ``siesta.core.ranks`` while the other ranks run
them in their processes (``siesta.core.rank_worker``), so each call is written once. Each rank
owns its shard: its weights, its KV cache, its sleep memory and its weight updater (which
writes this rank's slice of each full tensor a trainer sends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from siesta.core.device_memory import ArenaMemory, MemoryReport, SleepableMemory
from siesta.core.model_runner import ModelRunner, StepPlan
from siesta.model.loader import ModelSource, resolve_model
from siesta.weight_transfer.updater import UpdateFailed, WeightUpdater
from siesta.weight_transfer.wire import WeightTransferError


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

    def __init__(self, runner: ModelRunner, source: ModelSource, local_rank: int) -> None:
        self.runner = runner
        self.source = source
        self.memory: SleepableMemory | ArenaMemory = runner.sleepable_memory()
        self.updater = WeightUpdater(runner.config.weight_transfer, runner.model, runner.device, local_rank)

    # -- steps ---------------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> None:
        self.runner.run_plan(plan)

    # -- sleep ---------------------------------------------------------------------------

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

    def close(self) -> None:
        self.updater.close()
