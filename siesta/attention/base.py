"""The paged KV cache layout and the metadata attention backends consume.

Layout is block-first: ``cache[block, layer, k_or_v, slot_in_block, kv_head, head_dim]``.
One block holds every layer's K and V in one contiguous region, so moving a
block between tiers is a single copy. Its elements are the model's dtype, or fp8 under one K and
one V scale per layer (``kv_quant``): the scales are part of what the bytes mean.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import torch

from siesta.attention.kv_quant import KVScales, format_key, is_quantized

_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_T = TypeVar("_T")


@dataclass
class KVCache:
    tensor: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    # On CPU: the anonymous mapping behind ``tensor``. Its pages are zero until written and
    # committed only then, so a large cache costs what it holds; sleep gives them back.
    host_map: mmap.mmap | None = None
    # Per block: its memory holds whatever bits it was mapped with (after a wake), maybe NaN
    # patterns, which attention must never read in a block's unwritten slots (NaN * 0 is NaN).
    # None: every block is zero or written.
    unset: np.ndarray | None = field(default=None, repr=False)
    # fp8 caches: the per-layer scales every write divides by and every read multiplies by.
    scales: KVScales | None = None
    # Per layer, the (tensor, K view, V view) ``layer`` handed out: every step asks for every
    # layer's views, and slicing them anew cost ~5 us a layer of host time between graphs.
    _views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        num_layers = self.tensor.shape[1]
        if self.quantized and self.scales is None:
            self.scales = KVScales.default(num_layers)
        if self.scales is not None and self.scales.num_layers != num_layers:
            raise ValueError(f"{self.scales.num_layers} layers of KV scales for a cache of {num_layers} layers")

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        storage: torch.Tensor | None = None,
        prefault: bool = False,
        scales: KVScales | None = None,
    ) -> KVCache:
        """A zeroed cache; in ``storage`` (uint8, at least the cache's bytes) when given. On CPU
        its pages are committed as first written, or all now with ``prefault``. An fp8 ``dtype``
        takes ``scales`` (default: 1.0 for every layer)."""
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        nbytes = num_blocks * cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        if storage is None and torch.device(device).type == "cpu":
            host_map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Decode reads each request's blocks wherever the pool put them: with 4 KiB
                # pages, a TLB miss every few KiB once the pool is shuffled (2-core EPYC,
                # SmolLM2, 64 rows at context 600-1,100 over shuffled blocks: attention
                # 0.54-0.79 s a step on 4 KiB pages, 0.41-0.44 s on 2 MiB; a fresh pool's
                # near-consecutive blocks gain nothing: the throughput bench is unchanged).
                host_map.madvise(mmap.MADV_HUGEPAGE)
            raw = torch.frombuffer(host_map, dtype=torch.uint8)
            if prefault:
                raw[:: mmap.PAGESIZE].zero_()  # a write per page commits it (the pool is zero already)
            return cls(raw.view(dtype).view(shape), host_map, scales=scales)
        if storage is None:
            return cls(torch.zeros(shape, dtype=dtype, device=device), scales=scales)
        tensor = storage[:nbytes].view(dtype).view(shape)
        tensor.view(torch.uint8).zero_()  # fp8 has no fill on every device; zero bytes are zeros
        return cls(tensor, scales=scales)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def quantized(self) -> bool:
        """Whether the blocks hold scaled fp8 values (``layer_scales``) rather than the values."""
        return is_quantized(self.tensor.dtype)

    def layer_scales(self, layer_idx: int) -> tuple[float, float]:
        """The K and V scales of ``layer_idx`` (1.0 for a cache that is not quantized)."""
        return (1.0, 1.0) if self.scales is None else self.scales.layer(layer_idx)

    @property
    def format_key(self) -> str:
        """What the blocks' bytes mean (dtype, and the scales' digest for fp8): cache keys carry it."""
        return format_key(self.tensor.dtype, self.scales)

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Zero whole blocks, through bytes: fp8 tensors have no index_fill_ on the CPU."""
        self.tensor.view(torch.uint8).index_fill_(0, block_ids, 0)

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def block_size(self) -> int:
        return self.tensor.shape[3]

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def forget_contents(self) -> None:
        """Every block holds arbitrary bits now. Blocks are zeroed as steps first use them, not
        all at a wake: a 116 GB cache takes ~30 ms of the device to zero (H200), and the first
        tier loads of a resume waited behind it."""
        self.unset = np.ones(self.num_blocks, dtype=bool)

    def overwritten(self, block_ids: list[int]) -> None:
        """Blocks a copy writes whole (a tier load): they need no zeroing."""
        if self.unset is not None:
            self.unset[block_ids] = False

    def claim_unset(self, block_ids: np.ndarray) -> np.ndarray:
        """Those of ``block_ids`` still unset, marked written: the caller zeros them on the
        compute stream before it writes or reads them."""
        if self.unset is None:
            return _NO_BLOCKS
        ids = np.unique(block_ids[self.unset[block_ids]]).astype(np.int64)
        self.unset[ids] = False
        if not self.unset.any():
            self.unset = None
        return ids

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        cached = self._views.get(layer_idx)
        if cached is None or cached[0] is not self.tensor:  # made anew if the tensor was replaced
            cached = self._views[layer_idx] = (self.tensor, self.tensor[:, layer_idx, 0], self.tensor[:, layer_idx, 1])
        return cached[1], cached[2]


@dataclass
class AttentionMetadata:
    """One step's flattened batch: requests' new tokens laid end to end.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; its
    context (cached tokens plus the new ones) is ``seq_lens[i]`` long, so its new
    tokens sit at positions ``seq_lens[i] - q_len_i ... seq_lens[i] - 1`` and attend
    causally to everything before them. Token ``t``'s K/V go to flat slot
    ``slot_mapping[t] = block * block_size + offset``.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop over requests never synchronize.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # What a backend derives from the fields above (split plans, scratch buffers) once a step
    # and reuses in every layer: one metadata serves all of a step's layers, and re-deriving
    # it was most of the host time a layer between piecewise graphs. Never copied.
    step_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def once_a_step(self, key: tuple, make: Callable[[], _T]) -> _T:
        """``make()`` for the step's first layer; the others read it back (``step_cache``)."""
        if key not in self.step_cache:
            self.step_cache[key] = make()
        return self.step_cache[key]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_idx: int,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the new tokens' K/V, then attend causally over the paged context.

        ``q`` is ``[T, q_heads, head_dim]``, ``k``/``v`` are ``[T, kv_heads, head_dim]``
        (q_heads a multiple of kv_heads: grouped-query attention); returns ``q``'s shape,
        in ``out`` when given (a static buffer of a CUDA graph, say).
        """
