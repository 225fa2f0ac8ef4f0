"""Rank 0's handle on every tensor-parallel rank: one call runs on each, this one included,
and succeeds on all of them or is an error.

At tensor parallel 1 there are no other ranks and every call is the local one. Above it, the
other ranks run in processes of their own (``siesta.core.rank_worker``): rank 0 sends a call,
runs it itself, then gathers their answers. A step goes out unanswered (``launch``), once rank
0 has planned it, so a step refused while planning costs the other ranks nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from siesta.config import EngineConfig
from siesta.core.device_memory import MemoryReport
from siesta.core.model_runner import ModelRunner, StepPlan
from siesta.core.rank_ops import RankError, RankOps
from siesta.core.tier_ranks import TierRanksOnRank0
from siesta.distributed import group as rank_group
from siesta.distributed.processes import RankFailed, RankProcesses
from siesta.model.loader import ModelSource
from siesta.model.parallel import SINGLE, TensorParallel
from siesta.weight_transfer.receivers import Receiver
from siesta.weight_transfer.state import WeightState
from siesta.weight_transfer.updater import UpdateFailed, WeightUpdater
from siesta.weight_transfer.wire import WeightTransferError

logger = logging.getLogger(__name__)

WORKER_TARGET = "siesta.core.rank_worker:serve_rank"


class RankCallFailed(RuntimeError):
    """A call that rank 0 completed failed on another rank (which goes on running)."""

    def __init__(self, rank: int, error: RankError) -> None:
        super().__init__(f"tensor-parallel rank {rank}: {error.message}")
        self.rank, self.error = rank, error


class Ranks:
    def __init__(self, local: RankOps, procs: RankProcesses | None, timeout_s: float,
                 membership: rank_group.RankGroup | None = None) -> None:  # fmt: skip
        self.local = local
        self.procs = procs
        self.timeout_s = timeout_s
        self._membership = membership

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource, max_model_len: int) -> Ranks:
        """Every rank's runner: this one's here, the others' in their processes, built side by side."""
        par = config.parallel
        size = par.tensor_parallel_size
        if size == 1:
            runner = ModelRunner(config, source, max_model_len)
            return cls(RankOps(runner, source, local_rank=0), None, par.rank_timeout_s)
        device = config.torch_device()
        store = rank_group.host_store(size, par.rank_start_timeout_s)
        procs = RankProcesses(size, WORKER_TARGET, (config, store.port, max_model_len), par.heartbeat_timeout_s)
        try:
            membership = rank_group.join(0, size, device, par.rank_start_timeout_s, store=store, check=procs.check)
            runner = ModelRunner(config, source, max_model_len, tp=membership.tp)
            ready = procs.wait_ready(par.rank_start_timeout_s)
        except BaseException as e:
            procs.close()
            if procs.failure is not None and not isinstance(e, RankFailed):
                raise RankFailed(procs.failure) from e
            raise
        blocks = {runner.num_blocks, *(r["num_blocks"] for r in ready)}
        if len(blocks) != 1:  # the runners agree on it through a collective: a bug if not
            procs.close()
            raise RankFailed(f"the ranks' KV caches differ in size: {sorted(blocks)} blocks")
        logger.info("tensor parallel %d: every rank is up", size)
        return cls(RankOps(runner, source, local_rank=0), procs, par.rank_timeout_s, membership)

    @property
    def size(self) -> int:
        return 1 if self.procs is None else self.procs.size

    @property
    def tp(self) -> TensorParallel:
        return SINGLE if self._membership is None else self._membership.tp

    @property
    def runner(self) -> ModelRunner:
        return self.local.runner

    @property
    def peers(self) -> Ranks | None:
        """What the runner hands each step to (None at tensor parallel 1)."""
        return None if self.procs is None else self

    def tier_ranks(self) -> TierRanksOnRank0 | None:
        """What the KV tiers need of the ranks (None at tensor parallel 1)."""
        if self.procs is None:
            return None
        return TierRanksOnRank0(self.procs, self.runner.device, self.timeout_s)

    def launch(self, plan: StepPlan) -> None:
        self.procs.send("launch", plan, reply=False)

    def step_failed(self, error: Exception) -> RankFailed:
        # A peer's death breaks rank 0's collective at once (gloo: connection reset), a moment
        # before the watcher sees the process go; a hung peer, once the watcher has killed it.
        reason = self.procs.wait_for_failure(self.procs.heartbeat_timeout_s)
        if reason is not None:
            return RankFailed(reason)
        return RankFailed(f"rank 0 failed a step the other ranks run too ({type(error).__name__}: {error})")

    def run(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """``op`` on every rank; rank 0's result. Rank 0's own error wins; another rank's is a
        RankCallFailed (or RankFailed when it died or did not answer)."""
        return self.run_all(op, args, args, **kwargs)[0]

    def run_split(self, op: str, local_args: tuple[Any, ...], remote_args: tuple[Any, ...], **kwargs: Any) -> Any:
        """``run``, where the other ranks are sent other arguments (what can cross a process)."""
        return self.run_all(op, local_args, remote_args, **kwargs)[0]

    def run_all(self, op: str, local_args: tuple[Any, ...], remote_args: tuple[Any, ...], **kwargs: Any) -> list[Any]:
        """Every rank's result, in rank order."""
        if self.procs is None:
            return [getattr(self.local, op)(*local_args, **kwargs)]
        seq = self.procs.send(op, *remote_args, **kwargs)
        mine: Any = None
        error: BaseException | None = None
        try:
            mine = getattr(self.local, op)(*local_args, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised once the other ranks have answered
            error = e
        answers = self.procs.gather(seq, self.timeout_s)
        if error is not None:
            raise error
        for answer in answers:
            if not answer.ok:
                raise RankCallFailed(answer.rank, answer.value)
        return [mine, *(answer.value for answer in answers)]

    def check(self) -> None:
        if self.procs is not None:
            self.procs.check()

    def close(self) -> None:
        self.local.close()
        if self.procs is not None:
            self.procs.close()


class RankedMemory:
    """Sleep memory of every rank, released and restored together; bytes are the ranks' total."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.local = ranks.local.memory

    @property
    def keeps_addresses(self) -> bool:
        return self.local.keeps_addresses

    @property
    def weights_released(self) -> bool:
        return self.local.weights_released

    @property
    def kv_released(self) -> bool:
        return self.local.kv_released

    @property
    def weight_bytes(self) -> int:
        """Rank 0's (each rank holds its own shard)."""
        return self.local.weight_bytes

    @property
    def kv_bytes(self) -> int:
        return self.local.kv_bytes

    @property
    def backup(self):
        """Rank 0's host backup of its weights (each rank makes its own)."""
        return self.local.backup

    def release_kv_cache(self) -> MemoryReport:
        return self._total("release_kv_cache")

    def release_weights(self, backup: bool) -> MemoryReport:
        return self._total("release_weights", backup)

    def restore_kv_cache(self) -> MemoryReport:
        return self._total("restore_kv_cache")

    def restore_weights(self) -> tuple[MemoryReport, bool]:
        reports = self._everyone("restore_weights")
        return _sum([r for r, _ in reports]), reports[0][1]

    def _total(self, op: str, *args: Any) -> MemoryReport:
        return _sum(self._everyone(op, *args))

    def _everyone(self, op: str, *args: Any) -> list[Any]:
        return self.ranks.run_all(op, args, args)


def _sum(reports: list[MemoryReport]) -> MemoryReport:
    return MemoryReport(bytes=sum(r.bytes for r in reports), seconds=max(r.seconds for r in reports),
                        waited_s=max(r.waited_s for r in reports))


class RankedUpdater:
    """Every rank's weight updater, driven together. Rank 0's ``state`` is the engine's: a call
    that writes on some ranks and not on others leaves it torn (invariant 11), never whole."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.local: WeightUpdater = ranks.local.updater

    @property
    def state(self) -> WeightState:
        return self.local.state

    @property
    def receiver(self) -> Receiver:
        return self.local.receiver

    @property
    def groups(self) -> dict[str, Any]:
        return self.local.groups

    def expire(self) -> bool:
        if self.local.expire():
            self._close_others()
            return True
        return False

    def init_engine(self, init_info: Any) -> None:
        self.ranks.run("init_engine", init_info)

    def start(self) -> bool:
        return self.ranks.run("start_update")

    def close_update(self) -> None:
        self.local.state.close()
        self._close_others()

    def receive(self, update_info: Any, receiver: Receiver | None = None) -> int:
        """Through the configured backend on every rank; or through ``receiver``: one of SGLang's
        groups (each rank has its own, by name), or tensors handed over here (one rank only)."""
        if receiver is None:
            return self._writing(lambda: self.ranks.run("receive", update_info))
        name = next((n for n, r in self.local.groups.items() if r is receiver), None)
        if name is not None:
            return self._writing(lambda: self.ranks.run("receive_in_group", name, update_info))
        if self.ranks.size > 1:
            raise WeightTransferError("tensors handed to one rank cannot reach the others: use receive_serialized")
        return self.local.receive(update_info, receiver)

    def receive_serialized(self, serialized: list[Any], load_format: str | None) -> int:
        """SGLang's serialized_named_tensors: every rank decodes its own entry and writes its slice."""
        return self._writing(lambda: self.ranks.run("receive_serialized", serialized, load_format))

    def write(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        if self.ranks.size == 1:
            self.local.write(weights)
            return
        if isinstance(weights, Mapping):
            # Refused here, whole, before a tensor moves: the ranks get a list, which they stream.
            self.local.check(weights)
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        # Tensors cross to the other ranks by value: the weight-transfer calls are the fast way.
        moved = [(name, tensor.detach().to("cpu")) for name, tensor in items]
        self._writing(lambda: self.ranks.run_split("write", (items,), (moved,)))

    def write_path(self, path: str) -> None:
        """A checkpoint that every rank reads itself."""
        self._writing(lambda: self.ranks.run("write_path", path))

    def join_sglang_group(self, init_info: Any) -> str:
        """Every rank joins the trainer's group (SGLang's rendezvous) as rank_offset + its rank;
        returns the group's name."""
        return self.ranks.run("join_sglang_group", init_info)

    def begin_join_group(self, init_info: Any) -> str:
        """Every rank starts joining SGLang's group on a thread; returns the group's name."""
        return self.ranks.run("begin_join_group", init_info)

    def begin_init_engine(self, init_info: Any) -> None:
        """Every rank starts joining the configured (nccl) backend's group on a thread."""
        self.ranks.run("begin_init_engine", init_info)

    def join_done(self, name: str | None) -> bool:
        """Whether rank 0's join ended (the others meet the same trainer at the same store)."""
        return self.local.join_done(name)

    def finish_join(self, name: str | None) -> None:
        """Install every rank's new receiver, or raise the join's error. A join that failed on
        some ranks only leaves none of them in the group."""
        try:
            self.ranks.run("finish_join", name)
        except RankCallFailed:
            if name is not None:
                self.ranks.run("leave_group", name)
            raise

    def leave_group(self, name: str) -> bool:
        return self.ranks.run("leave_group", name)

    def close_group(self, name: str) -> None:
        """Close (not forget) a group whose broadcast cannot be read: the trainer joins again."""
        self.ranks.run("close_group", name)

    def close(self) -> None:
        self.local.close()

    def _writing(self, call) -> Any:
        """A write on every rank; another rank's failure after rank 0 wrote leaves the weights
        torn on rank 0's books: every tensor must come again (or a checkpoint)."""
        try:
            return call()
        except RankCallFailed as e:
            self.local.state.failed(f"a weight update broke off on {e}", set(self.local.state.expected))
            raise UpdateFailed(f"{e}; {self.local.state.describe()}") from None

    def _close_others(self) -> None:
        if self.ranks.procs is not None:
            seq = self.ranks.procs.send("close_update")
            for answer in self.ranks.procs.gather(seq, self.ranks.timeout_s):
                if not answer.ok:
                    raise RankCallFailed(answer.rank, answer.value)
