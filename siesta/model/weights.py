"""Where a full checkpoint tensor lands in a rank's parameters: the part of the model interface
that loaders, the weight updater and tensor parallelism share.

Every loader and every weight push hands over full Hugging Face tensors; a model's
``weight_target`` answers, per name, with a ``WeightTarget``: the full shape (checked before
anything is written) and the cuts of it this rank keeps, each already bound to its destination
(a parameter, some rows of a fused one, or one expert's slice of a stacked expert tensor).

A family plans each name once (``Plan``: parameter name, keys, full shape, ``Place``s, no
tensors) and binds the plan to the parameter; the bound target is kept while the parameter is
the same object at the same address (``to_empty`` gives parameters new storage; a CPU sleep
moves it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class WeightCut(NamedTuple):
    """``full.narrow(dim, start, length)`` of a full checkpoint tensor lands in ``dest``.

    Tuples, not dataclasses: a weight push builds a target per tensor, and a frozen
    dataclass's ``__init__`` costs a microsecond more per object (the 8B push is 291 tensors)."""

    dest: torch.Tensor
    dim: int
    start: int
    length: int
    whole: bool  # the cut is the full tensor itself: taken as is (no view to build per tensor)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.whole else full.narrow(self.dim, self.start, self.length)


class WeightTarget(NamedTuple):
    """Where a full checkpoint tensor goes on this rank, and which part of it this rank keeps.

    One cut, except for a fused tensor pushed whole under tensor parallelism: this rank's q, k
    and v rows (or gate and up rows, of every expert for a stacked ``gate_up_proj``) are
    separate ranges of it.
    """

    keys: tuple[str, ...]  # what ``load_weights`` reports written: "param", "param:shard", "param:shard:expert"
    full_shape: tuple[int, ...]  # the whole tensor's shape, as checkpoints and trainers hold it
    cuts: tuple[WeightCut, ...]

    @property
    def view(self) -> torch.Tensor:
        """This rank's destination of a one-cut target (what the checkpoint tensor's shard becomes)."""
        if len(self.cuts) != 1:
            raise ValueError(f"{self.keys} land in {len(self.cuts)} places on this rank, not one")
        return self.cuts[0].dest

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``: a view for one cut; the pieces of a fused tensor joined."""
        if len(self.cuts) == 1:
            return self.cuts[0].of(full)
        return torch.cat([cut.of(full) for cut in self.cuts], dim=self.cuts[0].dim)

    def write(self, full: torch.Tensor) -> None:
        """Copy this rank's part of ``full`` into the parameters (casting to their dtype)."""
        for cut in self.cuts:
            cut.dest.copy_(cut.of(full))


class Place(NamedTuple):
    """A WeightCut without its tensor: ``full.narrow(dim, start, length)`` lands in the
    destination's ``length`` rows from ``dest_offset`` along ``dim``. The destination is the
    parameter, or with ``expert`` that expert's slice of a stacked ``[experts, ...]`` parameter
    (``dim`` then counts the dims of the slice, which are the checkpoint tensor's)."""

    dim: int
    dest_offset: int
    start: int
    length: int
    whole: bool  # the cut is the full tensor itself
    all_rows: bool  # the destination is the whole parameter (or the whole expert slice)
    expert: int | None = None

    def bind(self, param: torch.Tensor) -> WeightCut:
        base = param if self.expert is None else param[self.expert]
        dest = base if self.all_rows else base.narrow(self.dim, self.dest_offset, self.length)
        return WeightCut(dest, self.dim, self.start, self.length, self.whole)


class Plan(NamedTuple):
    pname: str
    keys: tuple[str, ...]
    full_shape: tuple[int, ...]
    places: tuple[Place, ...]

    def bind(self, params: dict[str, torch.nn.Parameter]) -> WeightTarget:
        param = params[self.pname].data  # the parameter now (its storage, not the Parameter)
        places = self.places
        cuts = (places[0].bind(param),) if len(places) == 1 else tuple(place.bind(param) for place in places)
        return WeightTarget(self.keys, self.full_shape, cuts)


class CheckpointPart(NamedTuple):
    """What a family's name mapping makes of a checkpoint name: the parameter it lands in, the
    part of a fused parameter (``q``, ``gate``...) and the expert, where there is one."""

    pname: str
    shard: str | None = None
    expert: int | None = None


UNPLANNED = object()  # a name not planned yet (None is a plan: "not kept")
