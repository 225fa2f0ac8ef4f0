"""The weights serving now: every write of them, and the version they are published under.

Two ways in. A trainer in another process pushes through vLLM's weight-transfer calls
(``init_weight_transfer_engine`` once; then ``start_weight_update``, ``update_weights(update_info)``
as often as needed, ``finish_weight_update``): nothing steps while an update is open, and the
version advances at the finish. In-process callers and checkpoints pass tensors or a path to
``update_weights``, which advances the version at once when no update is open. SGLang's
one-call updates are transactions over this (``core/one_call_updates.py``).

Every write gets a new cache key and a name (``core/weight_versions.py``): what other weights
computed is then unreachable, and evicted from every tier when an update is published
(DESIGN.md, invariant 6). The engine core reads back the step in flight before any of these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from siesta.config import EngineConfig
from siesta.control import EngineStateError
from siesta.core.deferred import Deferred
from siesta.core.model_runner import ModelRunner
from siesta.core.ranks import RankedMemory, RankedUpdater, Ranks
from siesta.core.weight_versions import WeightVersions, check_version
from siesta.kv.kv_manager import KVManager
from siesta.metrics import EngineStats
from siesta.tiers.base import KVConnector
from siesta.weight_transfer.checkpoints import update_source
from siesta.weight_transfer.joining import join_timeout
from siesta.weight_transfer.receivers import Receiver
from siesta.weight_transfer.state import REPAIR
from siesta.weight_transfer.updater import UpdateFailed
from siesta.weight_transfer.wire import WeightTransferError, parse_nccl_init

RELEASED = "the weights are released: wake_up(tags=['weights']) before {call}"


class WeightUpdates:
    def __init__(
        self,
        config: EngineConfig,
        versions: WeightVersions,
        ranks: Ranks,
        runner: ModelRunner,
        kv: KVManager,
        connector: KVConnector | None,
        memory: RankedMemory,
        stats: EngineStats,
        rekey: Callable[[], None],
    ) -> None:
        self.config = config
        self.versions = versions
        self.ranks = ranks
        self.runner = runner
        self.kv = kv
        self.connector = connector
        self.memory = memory
        self.stats = stats
        self.rekey = rekey  # requests file their KV under the current key from now on
        self.updater = RankedUpdater(ranks)
        # Whole weights of one version, or why not; an open weight update holds every step.
        self.state = self.updater.state
        self.record_version()

    @property
    def name(self) -> str:
        """The name outputs report for the weights serving now."""
        return self.versions.name

    @property
    def key(self) -> str:
        """The key cached KV of the weights serving now is filed under (their identity)."""
        return self.versions.key

    # -- vLLM's weight-transfer calls -----------------------------------------------------

    def begin_transfer_engine(self, init_info: Any) -> Deferred:
        """Set up the configured backend (nccl: join the trainer's group; ipc: nothing to do), as a
        Deferred: nccl's rendezvous runs on a thread of every rank while the engine steps
        (weight_transfer/joining.py)."""
        if not self.updater.local.joins_by_rendezvous:
            self.updater.init_engine(init_info)
            return Deferred(lambda: True, lambda: None)
        parse_nccl_init(join_timeout(init_info, 1.0)[0])  # refused here, before any rank waits
        self.updater.begin_init_engine(init_info)
        return Deferred(lambda: self.updater.join_done(None), lambda: self.updater.finish_join(None))

    def start(self) -> None:
        """Open an update: no step runs until ``finish``."""
        self.check_not_released("a weight update")
        self.updater.start()

    def update(self, weights: Any, weight_version: str | None = None) -> str:
        """Write new weights in place; returns the weight version.

        ``weights``: an update_info (``{"update_info": {...}}`` or the bare dict) received
        through the backend; (name, tensor) pairs or a state dict with Hugging Face names; or
        a model path. Outside an open update, tensors and paths publish new weights at once,
        under the version named (naming the current one keeps the name) or else the next.
        Written weights always get a new cache key: the engine cannot tell equal weights from
        different ones without reading them all (``core/weight_versions.py``).
        """
        if weight_version is not None:
            weight_version = check_version(weight_version)  # refused before anything is written
        self.check_not_released("update_weights")
        info = _update_info(weights)
        if info is not None:
            opened = self.updater.start()  # vLLM lets update_weights open the update itself
            try:
                self.receive(info)
            except (WeightTransferError, UpdateFailed):
                if opened and not self.state.written:
                    self.updater.close_update()  # nothing written: as if never called
                raise
            return self.name
        implicit = not self.state.open
        if isinstance(weights, str):
            update_source(weights, self.runner.model.shape)  # nothing read before its shapes are known to fit
            self.updater.write_path(weights)
        else:
            self.updater.write(weights)
        if implicit:
            self.publish_written(weight_version)
        return self.name

    def finish(self, weight_version: str | None = None) -> str:
        """Close the update and publish its version (the next one unless named); evict what
        other weights computed, on the device and in every tier. Refused, with nothing
        changed, while the weights are not whole. An update that wrote nothing only renames
        (when a version is named): the weights, and so their cached KV, are the same."""
        if weight_version is not None:
            weight_version = check_version(weight_version)
        if not self.state.whole:
            raise EngineStateError(f"the weight update cannot finish: {self.state.describe()}; {REPAIR}")
        changed = self.state.open and bool(self.state.written)
        if self.state.open:
            self.updater.close_update()
        if changed:
            self.publish_written(weight_version)
        elif weight_version is not None:
            self.rename(weight_version)
        self.evict_other_versions()
        return self.name

    def reload(self) -> None:
        """Re-read the weights of the model source (after a level-2 sleep with no update).

        The engine then serves the checkpoint it started from, so it reports that checkpoint's
        version and reaches only KV the checkpoint computed; what later weights computed is
        evicted from every tier."""
        self.ranks.run("reload_weights")
        self.state.wrote(set(self.state.expected))
        self._use_kv_key(self.versions.reloaded_source)
        self.record_version()
        self.evict_other_versions()

    def check_not_released(self, call: str) -> None:
        if self.memory.weights_released:
            raise EngineStateError(RELEASED.format(call=call))

    # -- receiving ---------------------------------------------------------------------

    def receive(self, update_info: Any, receiver: Receiver | None = None) -> None:
        backend = (receiver or self.updater.receiver).backend
        self.receive_with(backend, lambda: self.updater.receive(update_info, receiver))

    def receive_with(self, backend: str, receive: Callable[[], int]) -> None:
        """``receive()`` (returning the bytes it took), counted under ``backend``."""
        t0 = time.perf_counter()
        try:
            nbytes = receive()
        except UpdateFailed:
            self.stats.inc("weight_transfer_failures", backend=backend)
            raise
        self.stats.inc("weight_transfer_seconds", time.perf_counter() - t0, backend=backend)
        self.stats.inc("weight_transfer_bytes", nbytes, backend=backend)

    # -- versions ----------------------------------------------------------------------

    def publish_written(self, weight_version: str | None) -> None:
        """New weights were written: they get a new cache key, and ``weight_version`` (else
        the next version) as their name."""
        self._use_kv_key(lambda: self.versions.wrote(weight_version))
        self.record_version()
        self.stats.inc("weight_updates")

    def rename(self, version: str) -> None:
        """The name outputs report from now on; what is cached stays keyed as it was."""
        version = check_version(version)
        if version == self.name:
            return
        self.versions.rename(version)
        self.record_version()

    def evict_other_versions(self) -> None:
        """Drop the device prefix cache and every tier entry other weights computed."""
        self.kv.reset_prefix_cache()
        if self.connector is not None:
            self.connector.evict_other_versions(self.key)

    def _use_kv_key(self, change: Callable[[], Any]) -> None:
        """``change()`` moves ``versions.key``; KV from now on is filed under the new key.
        Keys name weights, so nothing under a new key came from other weights."""
        before = self.key
        change()
        if self.key == before:
            return
        if self.connector is not None:
            self.connector.set_weight_version(self.key)
        self.rekey()

    def record_version(self) -> None:
        # One series, the live version's: a series per version ever served grows /metrics
        # without bound over an RL run's pushes (the registry drops the others).
        self.stats.set("weight_version_info", 1.0, version=self.name)
        if self.name.isdigit():
            self.stats.set("weight_version", float(self.name))


def _update_info(weights: Any) -> Any:
    """The update_info of a weight-transfer call (``{"update_info": ...}`` or the bare dict), else None."""
    if isinstance(weights, Mapping) and not isinstance(next(iter(weights.values()), None), torch.Tensor):
        if set(weights) == {"update_info"}:
            return weights["update_info"]
        if "names" in weights:
            return weights
    return None
