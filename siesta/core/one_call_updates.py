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
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from siesta.core.deferred import Deferred
from siesta.core.weight_versions import VersionError, check_version
from siesta.weight_transfer.checkpoints import update_source
from siesta.weight_transfer.pickled_tensors import SerializedTensors
from siesta.weight_transfer.receivers import LocalReceiver
from siesta.weight_transfer.sglang_group import DEFAULT_GROUP_NAME, REJOIN, parse_sglang_group
from siesta.weight_transfer.sglang_updates import distributed_update_info, tensor_update_info
from siesta.weight_transfer.wire import WeightTransferError, parse_update_info

if TYPE_CHECKING:
    from siesta.core.engine_core import EngineCore

# What the trainer is told when the engine has no such group.
_NO_GROUP = "no weight update group {name!r}: call " + REJOIN + " first"


class OneCallResult(msgspec.Struct, omit_defaults=True):
    weight_version: str
    kept_requests: int = 0  # requests in flight that were kept across the update (SGLang's num_paused_requests)
    missing_tensors: int = 0  # still to be written before the engine generates (a torn or released engine)


class OneCallUpdates:
    """EngineCore's one-call weight updates (mixed into ``EngineCore``)."""

    _serialized: SerializedTensors | None = None

    # -- SGLang's groups -------------------------------------------------------------

    def init_weights_update_group(self: EngineCore, init_info: Any) -> str:
        """Join the trainer's group through SGLang's rendezvous; returns its name."""
        return self.begin_weights_update_group(init_info).wait()

    def begin_weights_update_group(self: EngineCore, init_info: Any) -> Deferred:
        """Start joining on a thread of every rank (the engine steps meanwhile); the Deferred
        answers with the group's name once the trainer met the engine, or with why not."""
        self._settle()
        parse_sglang_group(init_info)  # refused here, before any rank waits at the rendezvous
        name = self.updater.begin_join_group(init_info)

        def finish() -> str:
            self.updater.finish_join(name)
            return name

        return Deferred(lambda: self.updater.join_done(name), finish)

    def destroy_weights_update_group(self: EngineCore, group_name: str = DEFAULT_GROUP_NAME) -> None:
        self._settle()
        if not self.updater.leave_group(group_name):
            raise WeightTransferError(_NO_GROUP.format(name=group_name))

    # -- updates -----------------------------------------------------------------------

    def update_weights_from_distributed(
        self: EngineCore,
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
            parse_update_info(info, self.config.weight_transfer)
            if options.get("weight_version") is not None:
                check_version(options["weight_version"])
        except (WeightTransferError, VersionError) as e:
            # Without a valid declaration the trainer's broadcast cannot be taken and dropped, and
            # left unread it would be read as the next update's: close the group instead.
            self.updater.close_group(group_name)
            raise WeightTransferError(f"{e}; weight update group {group_name!r} is closed: {REJOIN} again") from None
        return self._one_call_update(lambda: self._receive(info, receiver), **options)

    def update_weights_from_tensor(
        self: EngineCore, serialized: list[Any], load_format: str | None = None, **options: Any
    ) -> OneCallResult:
        """Tensors the trainer shares (CUDA IPC, or shared memory by name on the CPU), one entry per engine rank."""
        ranks = self.get_world_size()
        if not isinstance(serialized, list) or len(serialized) != ranks:
            count = len(serialized) if isinstance(serialized, list) else type(serialized).__name__
            raise WeightTransferError(f"serialized_named_tensors has one entry per engine rank ({ranks}), got {count}")
        if self._serialized is None:
            self._serialized = SerializedTensors(self.runner.device)
        named = self._serialized.decode(serialized[0], load_format)  # refused here: nothing aborted or written
        info, tensors = tensor_update_info(named)
        receiver = LocalReceiver(self.config.weight_transfer, self.runner.device, tensors)
        if ranks == 1:
            return self._one_call_update(lambda: self._receive(info, receiver), **options)
        # Every rank decodes its own entry (rank 0's again, in the transaction).
        backend = receiver.backend
        return self._one_call_update(lambda: self._receive_with(backend, lambda: self.updater.receive_serialized(
            serialized, load_format)), **options)  # fmt: skip

    def update_weights_from_disk(self: EngineCore, model_path: str, **options: Any) -> OneCallResult:
        # A path that is no model, or a model of other shapes, is refused before anything changes.
        if options.get("weight_version") is not None:
            check_version(options["weight_version"])
        update_source(model_path, self.runner.model.shape)
        return self._one_call_update(lambda: self.updater.write_path(model_path), **options)

    def update_weight_version(self: EngineCore, new_version: str, abort_all_requests: bool = True) -> str:
        """Rename the weights: outputs report ``new_version``; cached KV stays valid and reachable."""
        from siesta.core.engine_core import EngineStateError  # engine_core imports this module

        self._settle()
        new_version = check_version(new_version)  # refused before anything is aborted
        if self.weights.open:
            raise EngineStateError("a weight update is open: finish_weight_update names its version")
        if abort_all_requests:
            self.abort_requests(self._unfinished_ids())
        self._rename_weights(new_version)
        return self.weight_version

    def _one_call_update(
        self: EngineCore,
        receive: Callable[[], None],
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        empty_cache: bool = False,
    ) -> OneCallResult:
        from siesta.core.engine_core import EngineStateError  # engine_core imports this module

        self._settle()
        if weight_version is not None:
            weight_version = check_version(weight_version)  # refused before anything is aborted or written
        if self.memory.weights_released:
            raise EngineStateError("the weights are released: wake_up(tags=['weights']) before a weight update")
        if self.weights.open:
            raise EngineStateError("a weight update is open (start_weight_update): finish_weight_update first")
        if abort_all_requests:
            self.abort_requests(self._unfinished_ids())
        kept = len(self._unfinished_ids())
        self.updater.start()
        try:
            receive()
        finally:
            self.updater.close_update()  # the call is the whole update: written tensors stay, torn or not
        self._publish_written(weight_version)
        if flush_cache:
            self.kv.reset_prefix_cache()
        if self.connector is not None:
            self.connector.evict_other_versions(self.kv_version)
        if empty_cache and self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return OneCallResult(self.weight_version, kept, len(self.weights.missing))

    def _unfinished_ids(self: EngineCore) -> list[str]:
        return [*self.scheduler.requests, *(h.request_id for h in self._held)]
