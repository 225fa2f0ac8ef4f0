"""OffloadingConnector: full KV blocks stored to host memory (and optionally disk), loaded back on a hit.

Keys are the device prefix-cache keys, so they carry the model, the weight
version and the cache salt: an entry can only ever be served to a request that
would have computed the same KV. The tiers outlive pause and sleep; a request
preempted by a pause and resumed in the very step that reports the preemption
has its stores flushed and its load left alone, so keeping the tier is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from siesta.attention.base import KVCache
from siesta.kv.block_pool import Block
from siesta.kv.hashing import BlockHash, extend_block_hashes
from siesta.request import Request
from siesta.tiers.base import ConnectorContext, DropReason, KVConnector, StepTransfers, TierCopies
from siesta.tiers.copy_feeder import CopyFeeder
from siesta.tiers.disk_tier import DiskTier, DiskWrite
from siesta.tiers.host_tier import HostEntry, HostTier
from siesta.tiers.transfer import BlockCopier

logger = logging.getLogger(__name__)

DEFAULT_CPU_BYTES = 1 << 30
# Copies in flight at once in each direction (see copy_feeder). Loads are topped up by a
# thread as chunks land: a resume is gigabytes queued at once. Stores come a step's worth
# at a time and the step loop issues them (a thread would take the GIL from the steps
# it overlaps: H200, decode at batch 64 beside link-speed stores, +82 % step time from a
# thread against +11-19 % issued in-loop, bench/results/gpu-h200-2026-11-29-run7*).
DEFAULT_LOAD_WINDOW_BYTES = 512 << 20
DEFAULT_STORE_WINDOW_BYTES = 1 << 30
# Loads started and not landed before the scheduler stops looking up more waiting requests:
# loads land in admission order, so a request looked up behind this much would start no copy
# sooner, and its lookup (hashing ~20k tokens: ~4 ms) would delay the step. 4 GiB keeps the
# link busy through a step of ~75 ms at 55 GB/s (H200; a resume's steps take 10-60 ms).
DEFAULT_LOAD_LOOKAHEAD_BYTES = 4 << 30
ROLES_THAT_LOAD = ("kv_both", "kv_consumer")
ROLES_THAT_STORE = ("kv_both", "kv_producer")


@dataclass(frozen=True)
class OffloadConfig:
    block_size: int  # tokens per tier entry, a multiple of the device block size
    cpu_bytes_to_use: int
    disk_path: str | None
    disk_bytes_to_use: int
    offload_prompt_only: bool
    load_window_bytes: int
    store_window_bytes: int
    load_lookahead_bytes: int
    role: str

    @classmethod
    def parse(cls, extra: dict[str, Any], device_block_size: int, role: str) -> OffloadConfig:
        known = {"block_size", "cpu_bytes_to_use", "disk_path", "disk_bytes_to_use", "offload_prompt_only",
                 "load_window_bytes", "store_window_bytes", "load_lookahead_bytes"}  # fmt: skip
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"OffloadingConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        cfg = cls(
            block_size=int(extra.get("block_size", device_block_size)),
            cpu_bytes_to_use=int(extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES)),
            disk_path=extra.get("disk_path"),
            disk_bytes_to_use=int(extra.get("disk_bytes_to_use", 0)),
            offload_prompt_only=bool(extra.get("offload_prompt_only", False)),
            load_window_bytes=int(extra.get("load_window_bytes", DEFAULT_LOAD_WINDOW_BYTES)),
            store_window_bytes=int(extra.get("store_window_bytes", DEFAULT_STORE_WINDOW_BYTES)),
            load_lookahead_bytes=int(extra.get("load_lookahead_bytes", DEFAULT_LOAD_LOOKAHEAD_BYTES)),
            role=role,
        )
        if cfg.block_size <= 0 or cfg.block_size % device_block_size:
            raise ValueError(
                f"OffloadingConnector: block_size {cfg.block_size} must be a positive multiple of the "
                f"device block size {device_block_size}"
            )
        if cfg.cpu_bytes_to_use <= 0:
            raise ValueError("OffloadingConnector: cpu_bytes_to_use must be positive")
        for name in ("load_window_bytes", "store_window_bytes", "load_lookahead_bytes"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"OffloadingConnector: {name} must be positive")
        if cfg.disk_path is not None and cfg.disk_bytes_to_use <= 0:
            raise ValueError("OffloadingConnector: disk_path needs a positive disk_bytes_to_use")
        return cfg


@dataclass
class LoadPiece:
    """``count`` device blocks of one tier entry, from its block ``entry_first``, into the
    request's blocks from index ``request_first`` (``block_ids`` once they are allocated)."""

    key: BlockHash
    entry: HostEntry
    entry_first: int
    request_first: int
    count: int
    block_ids: list[int] = field(default_factory=list)


@dataclass
class LoadJob:
    request_id: str
    pieces: list[LoadPiece]

    @property
    def num_blocks(self) -> int:
        return sum(piece.count for piece in self.pieces)


@dataclass
class StoreJob:
    request_id: str
    key: BlockHash
    version: str
    blocks: list[Block]  # referenced until the copy is done, so never reused before
    parent: BlockHash | None = None  # the entry before it in the request's chain
    entry: HostEntry | None = None


class OffloadingConnector(KVConnector):
    supports_retained_cache_on_pause = True
    supports_tensor_parallel = True

    def __init__(self, extra_config: dict[str, Any], ctx: ConnectorContext, role: str = "kv_both") -> None:
        super().__init__(extra_config, ctx)
        self.cfg = OffloadConfig.parse(extra_config, ctx.block_size, role)
        self.blocks_per_entry = self.cfg.block_size // ctx.block_size
        entry_shape = (self.blocks_per_entry, *ctx.block_shape)
        self.host = HostTier(self.cfg.cpu_bytes_to_use, entry_shape, ctx.dtype, ctx.device, ranks=ctx.ranks)
        self.disk: DiskTier | None = None
        if self.cfg.disk_path is not None:
            # An entry's bytes are every rank's shards: a tier written at another tensor-parallel
            # size is another layout.
            fingerprint = ctx.model_fingerprint if ctx.ranks is None else f"{ctx.model_fingerprint}/tp{ctx.num_ranks}"
            self.disk = DiskTier(self.cfg.disk_path, fingerprint, self.cfg.disk_bytes_to_use, self.host.entry_bytes)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="siesta-disk") if self.disk is not None else None
        self.copier = BlockCopier(ctx.device)
        self.loads: TierCopies = CopyFeeder(self.copier, "in", self.cfg.load_window_bytes, ctx.block_bytes,
                                            threaded=self.copier.cuda)  # fmt: skip
        self.stores: TierCopies = CopyFeeder(self.copier, "out", self.cfg.store_window_bytes, ctx.block_bytes,
                                             threaded=False)  # fmt: skip
        # Rank 0's load feeder, whose busy seconds are the load seconds (at tensor parallel > 1
        # every rank moves the same bytes over its own link at the same time); benches trace it.
        self.load_feeder: CopyFeeder = self.loads
        self._load_seconds_seen = 0.0
        if ctx.ranks is not None:  # every rank copies its own part of each entry
            self.loads = ctx.ranks.copies(self.loads, "in", self.host.buffer)
            self.stores = ctx.ranks.copies(self.stores, "out", self.host.buffer)
        # Scheduler-side bookkeeping.
        self._matched: dict[str, list[LoadPiece]] = {}  # looked up this schedule(), pinned, not yet allocated
        self._wanted: dict[str, list[BlockHash]] = {}  # waiting, not looked up yet: the entries they will load
        self._pending_loads: dict[str, LoadJob] = {}  # allocated, left for run_loads (no kv_cache in ctx)
        self._stored_upto: dict[str, int] = {}  # per request: tier entries already planned or skipped
        self._planned: list[StoreJob] = []
        self._store_keys: set[BlockHash] = set()  # planned or in flight
        # Worker-side transfers still running.
        self._inflight_stores = 0  # handed to the feeder, not landed yet
        self._loading: dict[str, LoadJob] = {}  # handed to the feeder, not landed yet
        self._landed: list[str] = []  # requests whose loads finished, for the scheduler to pick up
        # Loading requests that joined a step before their loads landed: the events that step's
        # forward waits for on the device (build_step), and who is still on its way.
        self._landing_waits: list[Any] = []
        self._joined_ahead: set[str] = set()
        self._disk_writes: list[tuple[BlockHash, Future[DiskWrite]]] = []
        self._evictions_seen = {"host": 0, "disk": self.disk.evictions if self.disk is not None else 0}
        self._damaged_seen = 0  # the files the disk tier deleted at start count in the first report
        self._record_usage()

    # -- lookups -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self._release_match(request.request_id)
        self._release_wants(request.request_id)  # the lookup pins what it finds instead
        if self.cfg.role not in ROLES_THAT_LOAD:
            return 0
        bs, k = self.ctx.block_size, self.blocks_per_entry
        extend_block_hashes(request.block_hashes, request.all_token_ids, bs, request.hash_extra)
        first = num_computed_tokens // bs
        # The last token is always computed: its logits are what the next sample needs.
        limit = (request.num_tokens - 1) // bs
        pieces: list[LoadPiece] = []
        b = first
        while b < limit and (b // k + 1) * k <= len(request.block_hashes):
            j = b // k
            key = request.block_hashes[(j + 1) * k - 1]
            parent = request.block_hashes[j * k - 1] if j else None
            entry = self.host.lookup(key) or self._promote_from_disk(key, parent)
            if entry is None:
                break
            self.host.pin(key)
            end = min((j + 1) * k, limit)
            pieces.append(LoadPiece(key, entry, entry_first=b - j * k, request_first=b, count=end - b))
            b = end
        if pieces:
            self._matched[request.request_id] = pieces
        return (b - first) * bs

    def _promote_from_disk(self, key: BlockHash, parent: BlockHash | None) -> HostEntry | None:
        """Read a disk entry into a host slot; None if absent, damaged or no slot is free."""
        if self.disk is None or self.host.contains(key) or not self.disk.contains(key):
            return None  # a host entry not ready yet: a store of it is on its way in
        data = self.disk.read(key)
        if data is None or len(data) != self.host.entry_bytes:
            # Another layout's entry (another entry size, say): keys carry the KV format and the
            # weights, not every layout choice, and a mismatched copy must miss, not raise.
            return None
        entry = self.host.reserve(key, self.ctx.weight_version, parent)
        if entry is None:
            return None
        target = self.host.data(entry)
        target.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.host.commit(key)
        self.ctx.stats.inc("kv_offload_load_bytes", len(data), tier="disk")
        return entry

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed: int, num_external: int) -> None:
        self.ctx.stats.inc("external_prefix_cache_queries", request.num_tokens)
        self.ctx.stats.inc("external_prefix_cache_hits", num_external)
        pieces = self._matched.pop(request.request_id, [])
        if not num_external:
            for piece in pieces:
                self.host.unpin(piece.key)
            return
        for piece in pieces:
            piece.block_ids = block_ids[piece.request_first : piece.request_first + piece.count]
        job = LoadJob(request.request_id, pieces)
        if self.ctx.kv_cache is None:
            self._pending_loads[request.request_id] = job
            return
        # Started now, while the scheduler looks up the next request: a step that looked up and
        # allocated every waiting request before any copy began kept the link idle (16 requests
        # of 19.5k tokens: ~70 ms on the H200). The copies wait for every forward queued so far,
        # the last ones that may have read these blocks before they were freed.
        self._start_load(job, self.ctx.kv_cache, after=None)

    def may_start_loads(self) -> bool:
        unstarted = sum(job.num_blocks for job in self._pending_loads.values()) * self.ctx.block_bytes
        return self.loads.pending_bytes + unstarted < self.cfg.load_lookahead_bytes

    def want(self, waiting, token_budget: int) -> None:
        # A burst replayed into a tier that holds only part of it: the requests admitted first
        # recompute what the tier lost and store it, and least recently used first, the
        # entries evicted for it would be those of the requests still waiting: each replay
        # then loses more than the last (6 requests, a tier of 2/3 of them: none of the 30
        # entries it held was loaded). Marked wanted, they stay; a store with no room is dropped.
        if self.cfg.role not in ROLES_THAT_LOAD:
            return
        bs, k = self.ctx.block_size, self.blocks_per_entry
        for request in waiting:
            if token_budget <= 0:
                return
            if request.request_id in self._wanted or request.prompt_logprobs_pending:
                continue
            token_budget -= max(request.num_tokens - len(request.block_hashes) * bs, 0)
            extend_block_hashes(request.block_hashes, request.all_token_ids, bs, request.hash_extra)
            keys = []
            for j in range(len(request.block_hashes) // k):
                key = request.block_hashes[(j + 1) * k - 1]
                if not self.host.want(key):
                    break  # a lookup stops at the first miss: later entries would not be loaded
                keys.append(key)
            self._wanted[request.request_id] = keys

    def _release_wants(self, request_id: str) -> None:
        for key in self._wanted.pop(request_id, []):
            self.host.unwant(key)

    def _release_match(self, request_id: str) -> None:
        for piece in self._matched.pop(request_id, []):
            self.host.unpin(piece.key)

    # -- planning a step -----------------------------------------------------------------

    def build_step(self, sched) -> StepTransfers:
        for request_id in list(self._matched):  # looked up, but the device had no room
            self._release_match(request_id)
        # Stores planned last step read blocks the last forward filled: issue them now. A
        # preempted request's stores go with them (flushed); a load it got in this very
        # step, resuming, is its own job (started at its admission) and is left alone.
        transfers = StepTransfers(stores=self._planned, loads=list(self._pending_loads.values()),
                                  waits=self._landing_waits)  # fmt: skip
        self._planned, self._pending_loads, self._landing_waits = [], {}, []
        for request_id in sched.preempted_req_ids | sched.finished_req_ids:
            self._stored_upto.pop(request_id, None)
        for item in sched.scheduled:
            self._plan_stores(item.request, item.block_ids)
        return transfers

    def request_failed(self, request: Request) -> None:
        self._release_wants(request.request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self._release_wants(request.request_id)  # aborted while waiting
        # Its last full blocks may be planned by no step: the step that filled them planned
        # none, with async scheduling, whose tokens were still unseen then; no later step
        # schedules the request.
        self._plan_stores(request, block_ids)

    def _plan_stores(self, request: Request, block_ids: list[int]) -> None:
        if self.cfg.role not in ROLES_THAT_STORE or request.kv_mixes_versions:
            return
        bs, k = self.ctx.block_size, self.blocks_per_entry
        computed = request.num_computed_tokens  # after this step's forward
        if self.cfg.offload_prompt_only:
            computed = min(computed, request.num_prompt_tokens)
        extend_block_hashes(request.block_hashes, request.all_token_ids, bs, request.hash_extra)
        full = min(computed // (k * bs), len(request.block_hashes) // k)
        start = self._stored_upto.get(request.request_id, 0)
        for j in range(start, full):
            key = request.block_hashes[(j + 1) * k - 1]
            if key in self._store_keys or self.host.contains(key) or (self.disk is not None and self.disk.contains(key)):
                continue
            blocks = [self.ctx.pool.blocks[i] for i in block_ids[j * k : (j + 1) * k]]
            self.ctx.pool.touch(blocks)
            parent = request.block_hashes[j * k - 1] if j else None
            self._planned.append(StoreJob(request.request_id, key, self.ctx.weight_version, blocks, parent))
            self._store_keys.add(key)
        self._stored_upto[request.request_id] = max(start, full)

    def has_pending_work(self) -> bool:
        return bool(self._planned or self._inflight_stores or self._loading or self._disk_writes)

    # -- worker side ---------------------------------------------------------------------

    def run_stores(self, transfers: StepTransfers, kv_cache: KVCache) -> None:
        after = transfers.after
        if after is None and transfers.stores:
            after = self.stores.compute_mark()
        for job in transfers.stores:
            job.entry = self._reserve(job)
            if job.entry is None:  # every slot pinned by loads: counted as dropped
                self._finish_store(job, stored=False)
                continue
            parts = [(self.host.part(job.entry), [b.block_id for b in job.blocks])]
            self.stores.submit(job, parts, kv_cache, issue=False, after=after)
            self._inflight_stores += 1
            # Counted as issued, not as landed: an issued copy lands (a failed one stops every
            # later step), and so the count leaves with the step that started it, the one that
            # finished its request too (store_finished), not a step after the request's output.
            self.ctx.stats.inc("kv_offload_store_bytes", self.host.entry_bytes, tier="host")
        self.poll()  # issues the step's stores together

    def store_finished(self, request_ids: Collection[str], kv_cache: KVCache) -> None:
        ended = set(request_ids)
        now = [job for job in self._planned if job.request_id in ended]
        if now:
            self._planned = [job for job in self._planned if job.request_id not in ended]
            self.run_stores(StepTransfers(stores=now), kv_cache)  # after every forward queued so far

    def _reserve(self, job: StoreJob) -> HostEntry | None:
        """A host slot for the store. When every slot is busy with stores on their way to the
        disk, the oldest are finished (landed in host memory, then written) rather than the
        store dropped while the disk has room. None only when loads pin every slot."""
        entry = self.host.reserve(job.key, job.version, job.parent)
        while entry is None:
            if self._disk_writes:
                self._retire_disk_write(*self._disk_writes.pop(0))
            elif self._inflight_stores:
                self.stores.drain()  # the step's earlier stores land and start their disk writes
                self.poll()
            else:
                return None
            entry = self.host.reserve(job.key, job.version, job.parent)
        return entry

    def run_loads(self, transfers: StepTransfers, kv_cache: KVCache) -> None:
        for job in transfers.loads:
            self._start_load(job, kv_cache, transfers.after)
        self.poll()

    def _start_load(self, job: LoadJob, kv_cache: KVCache, after) -> None:
        """Queue the job behind the loads started before it: it lands before any later one."""
        self.ctx.stats.inc("kv_offload_load_bytes", job.num_blocks * self.ctx.block_bytes * self.ctx.num_ranks, tier="host")
        parts = []
        for piece in job.pieces:
            first = piece.entry_first
            parts.append((self.host.part(piece.entry)[first : first + piece.count], piece.block_ids))
            kv_cache.overwritten(piece.block_ids)  # whole blocks: none needs zeroing after a wake
        self._loading[job.request_id] = job
        self.loads.submit(job.request_id, parts, kv_cache, after=after)

    def join_ahead(self, within_s: float) -> list[str]:
        # One rank's copies only: at tensor parallel > 1 each rank's landing is its own event.
        if self.ctx.ranks is not None or within_s <= 0:
            return []
        joined = []
        for request_id, event in self.load_feeder.landing_within(within_s):
            if request_id in self._loading and request_id not in self._joined_ahead:
                self._joined_ahead.add(request_id)
                self._landing_waits.append(event)
                joined.append(request_id)
        return joined

    def wait_for_progress(self, timeout_s: float) -> None:
        """Block (releasing the GIL) until the oldest load chunk lands or ``timeout_s`` passes,
        for an engine with nothing to compute but loads in flight."""
        self.loads.wait_for_progress(timeout_s)

    def finished_loads(self) -> list[str]:
        self.poll()
        landed, self._landed = self._landed, []
        return landed

    def wait_for_loads(self) -> None:
        self.loads.drain()
        self.poll()

    def poll(self) -> None:
        # Take finished jobs off the lists before retiring them: a failure while retiring
        # one must not leave it to be retired (and its blocks freed) a second time.
        for job in self.stores.landed():
            self._inflight_stores -= 1
            self._finish_store(job, stored=True)
        for request_id in self.loads.landed():
            for piece in self._loading.pop(request_id).pieces:
                self.host.unpin(piece.key)
            self._joined_ahead.discard(request_id)
            self._landed.append(request_id)
        self._retire_disk_writes(block=False)
        self._record_usage()

    def _finish_store(self, job: StoreJob, stored: bool) -> None:
        self.ctx.pool.free(job.blocks)
        self._store_keys.discard(job.key)
        if not stored:
            self.ctx.count_dropped_stores("host", DropReason.NO_SPACE)
            return
        self.host.commit(job.key)
        if self.disk is not None and not self.disk.contains(job.key):
            self.host.pin(job.key)  # the writer reads the slot; it must not be reused meanwhile
            data = memoryview(self.host.data(job.entry).view(-1).view(torch.uint8).numpy())
            write = self._writer.submit(self.disk.write, job.key, job.version, data, job.parent)
            self._disk_writes.append((job.key, write))

    def _retire_disk_writes(self, block: bool) -> None:
        still = []
        for key, future in self._disk_writes:
            if block or future.done():
                self._retire_disk_write(key, future)
            else:
                still.append((key, future))
        self._disk_writes = still

    def _retire_disk_write(self, key: BlockHash, future: Future[DiskWrite]) -> None:
        written = future.result()
        self.host.unpin(key)
        if written.dropped is not None:
            self.ctx.count_dropped_stores("disk", written.dropped)
        self.ctx.stats.inc("kv_offload_store_bytes", written.nbytes, tier="disk")

    def wait_for_stores(self, kv_cache: KVCache) -> None:
        planned, self._planned = self._planned, []
        self.run_stores(StepTransfers(stores=planned), kv_cache)
        self.stores.drain()
        self.wait_for_loads()  # polls: retires the stores too
        self._retire_disk_writes(block=True)
        self._record_usage()

    # -- control -------------------------------------------------------------------------

    def reset_cache(self) -> None:
        self._drop_where(lambda key, version: True, DropReason.CACHE_RESET)

    def evict_other_versions(self, keep_version: str) -> None:
        self._drop_where(lambda key, version: version != keep_version, DropReason.VERSION_STALE)

    def _drop_where(self, predicate, reason: DropReason) -> None:
        # Stores not yet issued would bring dropped entries back: cancel those too.
        keep = []
        for job in self._planned:
            if predicate(job.key, job.version):
                self.ctx.pool.free(job.blocks)
                self._store_keys.discard(job.key)
            else:
                keep.append(job)
        self.ctx.count_dropped_stores("host", reason, len(self._planned) - len(keep))
        self._planned = keep
        self.stores.drain()
        self.poll()
        self._retire_disk_writes(block=True)
        self.host.evict_where(lambda key, entry: predicate(key, entry.version))
        if self.disk is not None:
            self.disk.evict_where(lambda key, entry: predicate(key, entry.version))
        self._record_usage()

    def _record_usage(self) -> None:
        # LRU evictions to make room happen inside the tiers; report the new ones.
        for tier, count in (("host", self.host.evictions), ("disk", self.disk.evictions if self.disk is not None else 0)):
            self.ctx.stats.inc("kv_offload_evictions", count - self._evictions_seen[tier], tier=tier)
            self._evictions_seen[tier] = count
        self.ctx.stats.set("kv_offload_bytes_used", self.host.bytes_used, tier="host")
        self.ctx.stats.set("kv_offload_bytes_capacity", self.host.capacity * self.host.entry_bytes, tier="host")
        if self.disk is not None:
            self.ctx.stats.set("kv_offload_bytes_used", self.disk.bytes_used, tier="disk")
            self.ctx.stats.set("kv_offload_bytes_capacity", self.disk.capacity, tier="disk")
            self.ctx.stats.inc("kv_offload_damaged_entries", self.disk.damaged - self._damaged_seen, tier="disk")
            self._damaged_seen = self.disk.damaged
        load_s = self.load_feeder.busy_seconds
        self.ctx.stats.inc("kv_offload_load_seconds", load_s - self._load_seconds_seen, tier="host")
        self._load_seconds_seen = load_s
