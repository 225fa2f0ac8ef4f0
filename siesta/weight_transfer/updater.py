"""The engine side of a weight transfer: check the declared tensors, receive, write in place.

Every name and shape is checked against the model before the first byte is received (the
full shape: a trainer sends whole tensors, and under tensor parallelism each rank keeps the
slice of each that ``CausalLM.weight_target`` names); a refused update writes nothing (an
nccl one is still received and dropped, so the trainer's broadcast completes and the group
stays in step). Tensors are copied into the parameters in place, casting on the device (fp32
masters into bf16 weights), so CUDA graphs and sleep arenas keep their addresses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from siesta.config import WeightTransferConfig
from siesta.device_activity import DEVICE_WORK
from siesta.model.interface import CausalModel as CausalLM
from siesta.model.interface import WeightTarget
from siesta.weight_transfer.joining import PendingJoin, join_timeout
from siesta.weight_transfer.receivers import Batch, NcclReceiver, Receiver, Rendezvous, TransferFailed, make_receiver
from siesta.weight_transfer.state import REPAIR, WeightState
from siesta.weight_transfer.wire import UpdateInfo, WeightTransferError, dtype_name, parse_update_info

logger = logging.getLogger(__name__)

# Cuts smaller than this are copied by multi-tensor launches (``_foreach_copy_``), larger ones one
# copy each (a memcpy where dtypes match). A per-expert push (Qwen3-30B-A3B: 10,614 tensors of
# ~3 MB) is bound by the launches: one copy each read 95 GB/s on an H100 (run 61a). For large
# tensors one copy each is the faster: a _foreach_copy_ of the 8B weights took 20 ms against
# 16.5 on the H200 (runs 24-25).
FOREACH_MAX_BYTES = 16 << 20


class UpdateFailed(RuntimeError):
    """An update broke off (the trainer died or went silent) after writing part of what it declared."""

    def __init__(self, message: str, written: set[str] | None = None, unwritten: set[str] | None = None) -> None:
        super().__init__(message)
        self.written = written or set()
        self.unwritten = unwritten or set()


def _joined(name: str | None) -> str:
    return "the weight-transfer group" if name is None else f"weight update group {name!r}"


class WeightUpdater:
    """Writes into the model and keeps ``state``: whether its weights are whole."""

    def __init__(
        self, config: WeightTransferConfig, model: CausalLM, device: torch.device, local_rank: int = 0
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.local_rank = local_rank
        self.receiver = make_receiver(config, device, local_rank)
        # Groups joined by name (SGLang's /init_weights_update_group; slime opens one per
        # pipeline stage), beside the configured backend's receiver.
        self.groups: dict[str, NcclReceiver] = {}
        self._joins: dict[str | None, PendingJoin] = {}  # rendezvous running on their threads
        self.state = WeightState(frozenset(model.expected_weight_names()))
        self.last_call = time.monotonic()  # of the open update (start, receive, write)

    @property
    def backend(self) -> str:
        return self.receiver.backend

    @property
    def ready(self) -> bool:
        return self.receiver.ready

    def init_engine(self, init_info: Any) -> None:
        if isinstance(self.receiver, NcclReceiver):
            self.begin_join(None, init_info, self.receiver.rendezvous)
            self.finish_join(None)
        else:
            self.receiver.init(init_info)

    @property
    def joins_by_rendezvous(self) -> bool:
        """Whether ``init_engine`` waits on a trainer (nccl), and so runs as a join."""
        return isinstance(self.receiver, NcclReceiver)

    def join_group(self, name: str, init_info: Any, rendezvous: Rendezvous) -> None:
        """Join (again: a trainer that restarts) the group ``name`` through ``rendezvous``."""
        self.begin_join(name, init_info, rendezvous)
        self.finish_join(name)

    def begin_join(self, name: str | None, init_info: Any, rendezvous: Rendezvous | None = None) -> None:
        """Start joining, on a thread (``joining``): the group ``name``, or with None the
        configured backend's. Nothing changes until ``finish_join``."""
        if name in self._joins:
            raise WeightTransferError(f"{_joined(name)} is being joined already: wait for that call's answer")
        init_info, timeout_s = join_timeout(init_info, self.config.join_timeout_s)
        receiver = NcclReceiver(self.config, self.device, self.local_rank, rendezvous)
        self._joins[name] = PendingJoin(receiver, init_info, timeout_s)

    def join_done(self, name: str | None) -> bool:
        join = self._joins.get(name)
        return join is None or join.done()

    def finish_join(self, name: str | None) -> None:
        """Install the receiver the join built (replacing the old one), or raise why it failed."""
        join = self._joins.get(name)
        if join is None:
            raise WeightTransferError(f"{_joined(name)} is not being joined")
        try:
            receiver = join.result()
        finally:
            del self._joins[name]
        if name is None:
            self.receiver.close()
            self.receiver = receiver
        else:
            self.leave_group(name)
            self.groups[name] = receiver

    def leave_group(self, name: str) -> bool:
        """Close the group ``name``; returns whether there was one."""
        receiver = self.groups.pop(name, None)
        if receiver is not None:
            receiver.close()
        return receiver is not None

    def start(self) -> bool:
        """Open an update unless one is open; returns whether this call opened it."""
        self.last_call = time.monotonic()
        if self.state.open:
            return False
        self.state.start()
        self.receiver.begin_update()
        return True

    def expire(self) -> bool:
        """Close an update the trainer left open for ``timeout_s`` without a call: as if never
        opened when it wrote nothing, else torn (the trainer died between its calls).
        Returns whether it closed one."""
        if not self.state.open or time.monotonic() - self.last_call <= self.config.timeout_s:
            return False
        idle = f"the weight update was left open for {self.config.timeout_s:g}s without a call or a finish"
        if self.state.written:
            self.state.failed(
                f"{idle} after writing {len(self.state.written)} tensors", self.state.expected - self.state.written
            )
        logger.warning("%s; %s", idle, "its tensors are not whole" if self.state.written else "it wrote nothing")
        self.state.close()
        return True

    def receive(self, update_info: Any, receiver: Receiver | None = None) -> int:
        """Receive one update through ``receiver`` (the configured backend's by default);
        returns the bytes received.

        Raises WeightTransferError (refused: nothing written) or UpdateFailed (broke off; if
        it wrote anything the weights are torn until the rest arrives).
        """
        self.last_call = time.monotonic()
        try:
            written, nbytes = self._receive(update_info, receiver or self.receiver)
        except UpdateFailed as e:
            if not e.written:  # broke off before the first tensor landed: the weights are as they were
                raise UpdateFailed(f"{e}; nothing was written, the weights are unchanged") from e
            self.state.wrote(e.written)
            self.state.failed(f"a weight transfer broke off ({e})", e.unwritten)
            raise UpdateFailed(f"{e}; {self.state.describe()}; {REPAIR}", e.written, e.unwritten) from e
        self.state.wrote(written)
        return nbytes

    def write(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Tensors handed over in process (Hugging Face or fused names). A state dict is checked
        whole first; a stream that breaks off after writing some leaves the weights torn."""
        if isinstance(weights, Mapping):
            self.check(weights)
            weights = weights.items()
        self.last_call = time.monotonic()
        DEVICE_WORK.touch()  # no backup pinning beside the copies (its driver lock)
        written: set[str] = set()
        try:
            self.model.load_weights(weights, written)
        except Exception as e:
            self.state.wrote(written)
            if written:
                self.state.failed(
                    f"update_weights stopped after {len(written)} tensors ({e})", self.state.expected - written
                )
            raise
        self.state.wrote(written)

    def check(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raises ValueError, naming the tensor, for a name the model has no place for or a full
        shape that is not the model's: a state dict is refused whole, before anything is written."""
        params = self.model.parameter_table()
        for name, tensor in weights.items():
            target = self.model.weight_target(name, params)
            if target is not None and target.full_shape != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model {target.full_shape}")

    def _receive(self, update_info: Any, receiver: Receiver) -> tuple[set[str], int]:
        info = parse_update_info(update_info, self.config)
        if not receiver.ready:
            raise WeightTransferError(receiver.not_ready())
        try:
            targets = self._targets(info)
        except WeightTransferError as refusal:
            try:
                receiver.drain(info)
            except TransferFailed as e:
                raise WeightTransferError(f"{refusal} (and the trainer's bytes could not be taken: {e})") from None
            raise
        written: set[str] = set()

        def accept(batch: Batch) -> None:
            # Under tensor parallelism each rank copies its slice of the full tensor it was sent
            # (a strided read of it, never a copy of the whole first).
            DEVICE_WORK.touch()  # no backup pinning beside the copies (its driver lock)
            dests: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            keys: list[str] = []
            with torch.no_grad():
                for meta, tensor in batch:
                    target = targets[meta.name]
                    if target is None:
                        continue
                    for cut in target.cuts:
                        if cut.dest.numel() * cut.dest.element_size() < FOREACH_MAX_BYTES:
                            dests.append(cut.dest)
                            srcs.append(cut.of(tensor))
                        else:
                            cut.dest.copy_(cut.of(tensor))
                    keys.extend(target.keys)
                if dests:
                    torch._foreach_copy_(dests, srcs)
            written.update(keys)

        declared = {key for t in targets.values() if t is not None for key in t.keys}
        try:
            receiver.receive(info, accept)
        except TransferFailed as e:
            raise UpdateFailed(str(e), written, declared - written) from e
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the trainer may reuse its buffers now
        return written, info.nbytes

    def _targets(self, info: UpdateInfo) -> dict[str, WeightTarget | None]:
        targets: dict[str, WeightTarget | None] = {}
        params = self.model.parameter_table()
        for meta in info.tensors:
            try:
                target = self.model.weight_target(meta.name, params)
            except ValueError as e:
                raise WeightTransferError(str(e)) from None
            if target is not None and target.full_shape != meta.shape:
                raise WeightTransferError(
                    f"{meta.name}: update_info declares shape {list(meta.shape)} ({dtype_name(meta.dtype)}) "
                    f"but the model's is {list(target.full_shape)}"
                )
            targets[meta.name] = target
        return targets

    def close(self) -> None:
        self.receiver.close()
        for name in list(self.groups):
            self.leave_group(name)
        for join in self._joins.values():  # one still waiting on its trainer ends with the process
            if join.done() and join.error is None:
                join.receiver.close()
        self._joins.clear()
