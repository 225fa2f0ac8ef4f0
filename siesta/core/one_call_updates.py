"""Weight updates that are one call each (SGLang's routes), and SGLang's named groups and version rename.

A one-call update is a whole weight-transfer update: abort the requests in flight if asked,
open the update, receive and write (through the updater every backend uses: names, shapes and
dtypes checked before the first byte is written), close it and publish its version (the one
named, else the next). The engine core serves one call at a time, so nothing steps meanwhile.
One that is refused writes nothing and leaves the version; one that breaks off after writing
some tensors leaves the weights torn, requests refused naming what is missing, until a later
update writes them (invariant 11).

A one-call update always wrote weights, so it gives them a new cache key
(``core/weight_versions.py``) whatever version it names: even one naming the current version
(slime sends every bucket of one update under one version) never keeps KV that other weights
computed. ``flush_cache`` resets the device prefix cache; KV of the old weights is unreachable
already, since every key carries the weights' key.

Renaming the version (``update_weight_version``) changes the name outputs report and nothing
else: the weights are the same, so the KV they computed stays valid, and stays reachable
because it is keyed by ``kv_version``, the weights' key, not their name. The next weights
written get a new key, so a rename can neither serve stale KV nor strand valid KV.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from siesta.control import EngineStateError, OneCallResult
from siesta.core.deferred import Deferred
from siesta.core.weight_versions import VersionError, check_version
from siesta.core.weights import WeightUpdates
from siesta.weight_transfer.checkpoints import update_source
from siesta.weight_transfer.pickled_tensors import SerializedTensors
from siesta.weight_transfer.receivers import LocalReceiver
from siesta.weight_transfer.sglang_group import DEFAULT_GROUP_NAME, REJOIN, parse_sglang_group
from siesta.weight_transfer.sglang_updates import distributed_update_info, tensor_update_info
from siesta.weight_transfer.wire import WeightTransferError, parse_update_info

# What the trainer is told when the engine has no such group.
_NO_GROUP = "no weight update group {name!r}: call " + REJOIN + " first"


# Ends requests, their outputs going out as any abort's: the engine's, handed to each call (a
# part holds no reference back to the engine).
Abort = Callable[[list[str]], None]


class OneCallUpdates:
    """SGLang's weight calls over the engine's weights; the engine core reads back the step in
    flight before each."""

    def __init__(self, weights: WeightUpdates, unfinished_ids: Callable[[], list[str]]) -> None:
        self.weights = weights
        self.updater = weights.updater
        self.unfinished_ids = unfinished_ids  # requests held or scheduled
        self._serialized: SerializedTensors | None = None

    # -- SGLang's groups -------------------------------------------------------------

    def begin_join_group(self, init_info: Any) -> Deferred:
        """Start joining on a thread of every rank (the engine steps meanwhile); the Deferred
        answers with the group's name once the trainer met the engine, or with why not."""
        parse_sglang_group(init_info)  # refused here, before any rank waits at the rendezvous
        name = self.updater.begin_join_group(init_info)

        def finish() -> str:
            self.updater.finish_join(name)
            return name

        return Deferred(lambda: self.updater.join_done(name), finish)

    def destroy_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        if not self.updater.leave_group(group_name):
            raise WeightTransferError(_NO_GROUP.format(name=group_name))

    # -- updates -----------------------------------------------------------------------

    def from_distributed(
        self,
        abort: Abort,
        names: Any,
        dtypes: Any,
        shapes: Any,
        group_name: str = DEFAULT_GROUP_NAME,
        load_format: str | None = None,
        **options: Any,
    ) -> OneCallResult:
        """The trainer broadcasts while this call runs (each tensor, or one flattened bucket)."""
        receiver = self.updater.groups.get(group_name)
        if receiver is None:
            raise WeightTransferError(_NO_GROUP.format(name=group_name))
        try:
            info = distributed_update_info(names, dtypes, shapes, load_format)
            parse_update_info(info, self.weights.config.weight_transfer)
            if options.get("weight_version") is not None:
                check_version(options["weight_version"])
        except (WeightTransferError, VersionError) as e:
            # Without a valid declaration the trainer's broadcast cannot be taken and dropped, and
            # left unread it would be read as the next update's: close the group instead.
            self.updater.close_group(group_name)
            raise WeightTransferError(f"{e}; weight update group {group_name!r} is closed: {REJOIN} again") from None
        return self._transaction(abort, lambda: self.weights.receive(info, receiver), **options)

    def from_tensor(
        self, abort: Abort, serialized: list[Any], load_format: str | None = None, **options: Any
    ) -> OneCallResult:
        """Tensors the trainer shares (CUDA IPC, or shared memory by name on the CPU), one entry per engine rank."""
        ranks = self.weights.ranks.size
        if not isinstance(serialized, list) or len(serialized) != ranks:
            count = len(serialized) if isinstance(serialized, list) else type(serialized).__name__
            raise WeightTransferError(f"serialized_named_tensors has one entry per engine rank ({ranks}), got {count}")
        device = self.weights.runner.device
        if self._serialized is None:
            self._serialized = SerializedTensors(device)
        named = self._serialized.decode(serialized[0], load_format)  # refused here: nothing aborted or written
        info, tensors = tensor_update_info(named)
        receiver = LocalReceiver(self.weights.config.weight_transfer, device, tensors)
        if ranks == 1:
            return self._transaction(abort, lambda: self.weights.receive(info, receiver), **options)
        # Every rank decodes its own entry (rank 0's again, in the transaction).
        backend = receiver.backend

        def receive() -> None:
            self.weights.receive_with(backend, lambda: self.updater.receive_serialized(serialized, load_format))

        return self._transaction(abort, receive, **options)

    def from_disk(self, abort: Abort, model_path: str, **options: Any) -> OneCallResult:
        # A path that is no model, or a model of other shapes, is refused before anything changes.
        if options.get("weight_version") is not None:
            check_version(options["weight_version"])
        update_source(model_path, self.weights.runner.model.shape)
        return self._transaction(abort, lambda: self.updater.write_path(model_path), **options)

    def rename(self, abort: Abort, new_version: str, abort_all_requests: bool = True) -> str:
        """Rename the weights: outputs report ``new_version``; cached KV stays valid and reachable."""
        new_version = check_version(new_version)  # refused before anything is aborted
        if self.weights.state.open:
            raise EngineStateError("a weight update is open: finish_weight_update names its version")
        if abort_all_requests:
            abort(self.unfinished_ids())
        self.weights.rename(new_version)
        return self.weights.name

    def _transaction(
        self,
        abort: Abort,
        receive: Callable[[], None],
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        empty_cache: bool = False,
    ) -> OneCallResult:
        weights = self.weights
        if weight_version is not None:
            weight_version = check_version(weight_version)  # refused before anything is aborted or written
        weights.check_not_released("a weight update")
        if weights.state.open:
            raise EngineStateError("a weight update is open (start_weight_update): finish_weight_update first")
        if abort_all_requests:
            abort(self.unfinished_ids())
        kept = len(self.unfinished_ids())
        self.updater.start()
        try:
            receive()
        finally:
            self.updater.close_update()  # the call is the whole update: written tensors stay, torn or not
        weights.publish_written(weight_version)
        if flush_cache:
            weights.kv.reset_prefix_cache()
        if weights.connector is not None:
            weights.connector.evict_other_versions(weights.key)
        if empty_cache and weights.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return OneCallResult(weights.name, kept, len(weights.state.missing))
