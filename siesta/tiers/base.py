"""The connector interface between the engine and the tiers below the device KV cache.

Scheduler side: ``get_num_new_matched_tokens`` (how many more tokens a tier holds
for a request), ``update_state_after_alloc`` (plan the loads into the request's
new device blocks, or start them), ``build_step`` (this step's loads and the stores the
previous step made possible). Worker side: ``run_loads`` before the forward,
``run_stores`` at the start of the next step, ``store_finished`` once a request ends.
Control: ``reset_cache``, ``evict_other_versions``, ``wait_for_stores``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from siesta.metrics import EngineStats

if TYPE_CHECKING:
    from siesta.attention.base import KVCache
    from siesta.kv.block_pool import BlockPool
    from siesta.request import Request


class ScheduledRow(Protocol):
    """One request of a step, as a connector reads it (the scheduler's ScheduledRequest)."""

    request: Request
    block_ids: list[int]


class ScheduledStep(Protocol):
    """A scheduled step, as a connector reads it (the scheduler's SchedulerOutput): declared
    here so that tiers need not import the core, which imports them."""

    scheduled: Sequence[ScheduledRow]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]


class DropReason(StrEnum):
    """Why a tier store was not made: the ``reason`` label of ``kv_offload_dropped_stores``."""

    # No room could be made: every host slot pinned by loads; or a disk entry larger than the
    # budget, or one that only its own parent's eviction could make room for.
    NO_SPACE = "no_space"
    # Not written to the disk tier, which does not hold the entry before it (evicted, damaged,
    # or never written): no lookup could reach it there. It stays in the host tier.
    PARENT_MISSING = "parent_missing"
    # The disk tier could not write the file (the entry stays in the host tier).
    IO_ERROR = "io_error"
    # Planned, then cancelled: the weights that computed it were replaced (finish_weight_update).
    VERSION_STALE = "version_stale"
    # Planned, then cancelled: the tier was cleared (clear_connector_cache, reset_external).
    CACHE_RESET = "cache_reset"


class TierCopies(Protocol):
    """A copy window as a connector drives it (``CopyFeeder``, or at tensor parallel > 1 one
    that also makes every other rank's copy of each job and reports a job once all landed)."""

    def submit(self, job_id: object, parts: Sequence[tuple[torch.Tensor, Sequence[int]]], kv: KVCache,
               issue: bool = True, after: Any = None) -> None: ...  # fmt: skip
    def compute_mark(self) -> Any: ...
    def landed(self) -> list[object]: ...
    @property
    def pending_bytes(self) -> int: ...
    def busy(self) -> bool: ...
    def wait_for_progress(self, timeout_s: float) -> None: ...
    def drain(self) -> None: ...


class TierRanks(Protocol):
    """The tensor-parallel ranks, as a connector sees them (``siesta.core.tier_ranks``): each
    holds its shard of every block, so a tier slot holds every rank's shard, side by side, in
    host memory that every rank maps; a copy is made by every rank, into its own part."""

    size: int

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``[slots, size, ...]`` in memory every rank maps (pinned on CUDA)."""
        ...

    def copies(self, local: Any, direction: str, buffer: torch.Tensor) -> TierCopies:
        """``local`` (rank 0's feeder) and the other ranks' copies of each job, into ``buffer``."""
        ...


@dataclass
class ConnectorContext:
    """What a connector learns about the engine it serves."""

    block_size: int  # device block size, in tokens
    block_shape: tuple[int, ...]  # one device block: [num_layers, 2, block_size, kv_heads, head_dim]
    dtype: torch.dtype
    device: torch.device
    model_fingerprint: str
    weight_version: str
    stats: EngineStats
    pool: BlockPool  # device blocks: stores hold a reference until their copy is done
    # The device cache loads write into and stores read from; it lives as long as the engine
    # (sleep unmaps and remaps it in place). A connector may start a load as soon as the
    # scheduler allocates the request's blocks.
    kv_cache: KVCache | None = None
    # Tensor parallelism above 1 (None: one rank). ``block_shape`` is then one rank's shard.
    ranks: TierRanks | None = None

    @property
    def num_ranks(self) -> int:
        return 1 if self.ranks is None else self.ranks.size

    def count_dropped_stores(self, tier: str, reason: DropReason, count: int = 1) -> None:
        """Stores not made into ``tier`` (the tier the store was for), and why."""
        self.stats.inc("kv_offload_dropped_stores", count, tier=tier, reason=reason.value)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class StepTransfers:
    """The tier work of one step; what ``build_step`` returns and the model runner executes."""

    loads: list[Any] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)
    # A composite connector's children, each with its own share of the step.
    parts: list[tuple[KVConnector, StepTransfers]] = field(default_factory=list)
    # The compute the copies wait for: the forwards that filled the stored blocks and the last
    # ones that read the blocks loads overwrite. None: all queued when the copies are issued.
    after: Any = None
    # Loads of requests that joined this step before landing (``join_ahead``): the step's
    # forward waits for these events on the device, and so does every step queued after it.
    waits: list[Any] = field(default_factory=list)

    def mark(self, event: Any) -> None:
        """Set ``after`` here and in every child's share."""
        self.after = event
        for _, sub in self.parts:
            sub.mark(event)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or any(sub for _, sub in self.parts))


class KVConnector(ABC):
    """Base of every connector. Subclasses that handle a request being preempted and
    resumed in the same step, with its tier entries kept across a pause, set
    ``supports_retained_cache_on_pause = True``."""

    supports_retained_cache_on_pause: ClassVar[bool] = False
    # Runs where every tensor-parallel rank holds a shard of each block (``ctx.ranks``).
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, extra_config: dict[str, Any], ctx: ConnectorContext) -> None:
        self.extra_config = extra_config
        self.ctx = ctx

    @property
    def name(self) -> str:
        return type(self).__name__

    def retention_refusal(self) -> str:
        return (
            f"{self.name} cannot keep its cache across a pause: the resume lands in the step that "
            "reports the pause's preemptions, which this connector does not expect. "
            "Drop clear_connector_cache=False."
        )

    # -- scheduler side ----------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (block-aligned) that this connector can load."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed: int, num_external: int) -> None:
        """The request got device blocks; plan loading ``num_external`` tokens after ``num_computed``."""

    def may_start_loads(self) -> bool:
        """Whether the scheduler may look up another waiting request now (False while the
        loads already started keep the link busy for a while: a later lookup costs the step
        loop time and would start no copy sooner)."""
        return True

    def want(self, waiting: Iterable[Request], token_budget: int) -> None:
        """Requests that wait to be looked up: keep what the tiers hold for them from being
        evicted to make room for stores until they are (hashing at most ``token_budget`` of
        their tokens now; the rest in a later step)."""

    def request_failed(self, request: Request) -> None:
        """The request ended in an error: forget it, storing nothing of its KV."""

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """The request ends (it stopped, reached its length or was aborted) and still holds
        ``block_ids``: plan the stores of the full blocks it filled that no step planned yet
        (its last ones), for ``store_finished`` to start."""

    @abstractmethod
    def build_step(self, sched: ScheduledStep) -> StepTransfers:
        """This step's loads, plus stores of blocks that earlier steps filled."""

    def has_pending_work(self) -> bool:
        """Stores still to issue or finish: the engine keeps stepping until they are done."""
        return False

    def set_weight_version(self, version: str) -> None:
        self.ctx.weight_version = version

    @abstractmethod
    def reset_cache(self) -> None:
        """Drop every entry."""

    @abstractmethod
    def evict_other_versions(self, keep_version: str) -> None:
        """Drop entries that weights other than ``keep_version`` computed."""

    # -- worker side -----------------------------------------------------------------

    @abstractmethod
    def run_loads(self, transfers: StepTransfers, kv_cache: KVCache) -> None:
        """Start this step's loads into their (unpublished) device blocks; ``finished_loads``
        reports each request once its KV has landed."""

    @abstractmethod
    def run_stores(self, transfers: StepTransfers, kv_cache: KVCache) -> None:
        """Start copying stored blocks out; completion is picked up by ``poll``."""

    def poll(self) -> None:
        """Retire finished transfers (release their device blocks)."""

    def store_finished(self, request_ids: Collection[str], kv_cache: KVCache) -> None:
        """These requests just ended, their last step read back: start the stores of the
        blocks they filled now, not at the next step, so their KV is in the tier (and counted)
        by the time their outputs go out."""

    def finished_loads(self) -> list[str]:
        """Requests whose loads have landed since the last call: they may compute now."""
        return []

    def join_ahead(self, within_s: float) -> list[str]:
        """Loading requests whose loads are expected to land within ``within_s`` (when the step
        scheduled now starts on the device): they may join it, which then waits for their
        landing on the device (``StepTransfers.waits``); ``finished_loads`` still reports them
        once they land. Empty where the landing cannot be waited for on the device."""
        return []

    def wait_for_loads(self) -> None:
        """Block until every load in flight has landed."""

    def wait_for_progress(self, timeout_s: float) -> None:
        """Called when nothing can compute: block a little (releasing the GIL) while transfers run."""

    @abstractmethod
    def wait_for_stores(self, kv_cache: KVCache) -> None:
        """Issue and finish every store; after this no device block is being read."""

