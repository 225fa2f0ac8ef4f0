"""CPU attention: the torch reference, with decode rows and prompt chunks read in place by
compiled kernels.

Decode on the CPU is bound by reading the paged K/V. The torch path gathers each
row's blocks into a new tensor before SDPA reads them (``torch_ref``); the kernel in
``cpu_decode.c`` walks the block tables instead and reads every byte once. Its rows are
split into ranges of about equal context, one for each of torch's OpenMP threads: Python
threads would share the cores with that team, which spins a while after every matmul
(this halved decode attention's time inside the engine).
A prompt chunk is bound by compute: ``cpu_prefill.c`` attends every chunk of a step in one
call, in register tiles, at 1.3-2.3x torch's flash SDPA (``python -m
siesta.bench.cpu_prefill``), its tasks split with OpenMP. Its tiles are the build target's
(AVX-512, AVX2, NEON), and so are the shapes it takes: the built library says which
(``prefill_limits``).
Both are built on first use (``siesta/c_kernels.py``). Without a compiler, or for shapes
and dtypes they do not take, the torch path serves.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from siesta import c_kernels
from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.torch_ref import TorchAttention
from siesta.c_kernels import CFLAGS, NATIVE

SOURCE = Path(__file__).with_name("cpu_decode.c")
PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.c")
# The kernel's stack buffers (MAX_Q_HEADS, MAX_STATE, MAX_BLOCK in cpu_decode.c): a row's query
# heads, its query heads x head_dim, the block size.
MAX_Q_HEADS, MAX_STATE, MAX_BLOCK = 128, 8192, 128

_I64, _F32P, _I32P, _I64P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
_ARGTYPES = [
    _F32P, _I64, _I64,  # q, its token and head strides
    _F32P, _F32P, _I64, _I64, _I64,  # K and V cache views, block/slot/head strides
    _I32P, _I64,  # block tables, row stride
    _I64P, _I64P, _I64P, _I64, _I64,  # per row: request, token, context length; the row range
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,  # kv heads, group, head_dim, block, scale
    _F32P, _I64, _I64,  # out, its token and head strides
]  # fmt: skip
_PARTS_ARGTYPES = _ARGTYPES[:13] + [_I64P, ctypes.c_int] + _ARGTYPES[15:]  # the row range: bounds, parts
_WRITE_KV_ARGTYPES = [
    _F32P, _I64, _F32P, _I64, _I64,  # new K and V rows, their token strides, tokens
    _I64P, _F32P, _F32P, _I64, _I64,  # slots; K and V cache views, block and slot strides
    ctypes.c_int, _I64,  # block size, floats a row
]  # fmt: skip
_PREFILL_ARGTYPES = [
    _F32P, _I64, _I64,  # q, its token and head strides
    _F32P, _F32P, _I64, _I64, _I64,  # K and V cache views, block/slot/head strides
    _I32P, _I64,  # block tables, row stride
    _I64P, _I64P, _I64P, _I64P, _I64,  # per request: table row, first query row, new tokens, context; requests
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,  # kv heads, group, head_dim, block, scale
    _F32P, _I64, _I64,  # out, its token and head strides
]  # fmt: skip


@functools.cache
def load_kernel(march: str = NATIVE) -> ctypes.CDLL | None:
    """The compiled decode kernel for ``march`` (the engine's: this machine's), built once per
    source, flags and ISA; None without a C compiler or where it does not build."""
    return build_kernel(SOURCE.read_bytes(), c_kernels.with_march(CFLAGS, march))


def build_kernel(source: bytes, flags: tuple[str, ...] = CFLAGS) -> ctypes.CDLL | None:
    """``source`` (a ``paged_decode`` of this module's signature) built and bound; None without a
    working C compiler. The benchmark also builds past versions."""
    lib = c_kernels.build("cpu_decode", source, flags)
    if lib is None:
        return None
    lib.paged_decode.argtypes = _ARGTYPES
    lib.paged_decode.restype = None
    if hasattr(lib, "paged_decode_parts"):  # past builds (the benchmark's baseline) lack these
        lib.paged_decode_parts.argtypes = _PARTS_ARGTYPES
        lib.paged_decode_parts.restype = None
    if hasattr(lib, "write_kv_rows"):
        lib.write_kv_rows.argtypes = _WRITE_KV_ARGTYPES
        lib.write_kv_rows.restype = None
    return lib


@functools.cache
def load_prefill_kernel(march: str = NATIVE) -> ctypes.CDLL | None:
    """The compiled prefill kernel (``cpu_prefill.c``) for ``march``; None without a C compiler
    or where it does not build."""
    lib = c_kernels.build("cpu_prefill", PREFILL_SOURCE.read_bytes(), c_kernels.with_march(CFLAGS, march))
    if lib is not None:
        lib.paged_prefill.argtypes = _PREFILL_ARGTYPES
        lib.paged_prefill.restype = ctypes.c_int
        for limit in ("prefill_max_group", "prefill_dim_tile"):
            getattr(lib, limit).argtypes = []
            getattr(lib, limit).restype = ctypes.c_int
        # A task's query rows (ROWS) hold at least one token's group; head_dim is covered by
        # whole register tiles (DIM_TILE). Both are the build target's.
        lib.limits = (lib.prefill_max_group(), lib.prefill_dim_tile())
    return lib


def prefill_limits(lib: ctypes.CDLL) -> tuple[int, int]:
    """``(max_group, dim_tile)`` of a prefill build: it takes group <= max_group and head_dim a
    multiple of dim_tile (48 and 64 under AVX-512, 24 and 16 under AVX2)."""
    return lib.limits


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self, num_threads: int | None = None, kernel: ctypes.CDLL | None = None,
                 prefill_kernel: ctypes.CDLL | None = None) -> None:  # fmt: skip
        self.num_threads = num_threads or torch.get_num_threads()
        self.kernel = kernel  # None: load_kernel()'s (a benchmark passes another build)
        self.prefill_kernel = prefill_kernel  # None: load_prefill_kernel()'s
        self._pool: ThreadPoolExecutor | None = None  # only for past builds without paged_decode_parts

    def _decode(self, q, kv_cache: KVCache, layer_idx: int, meta: AttentionMetadata, scale: float,
                rows: list[int], out: torch.Tensor) -> None:  # fmt: skip
        k_cache, v_cache = kv_cache.layer(layer_idx)
        lib = self.kernel or load_kernel()
        if lib is None or not self._takes(q, k_cache, out):
            super()._decode(q, kv_cache, layer_idx, meta, scale, rows, out)
            return
        self._run_decode_kernel(lib, q, k_cache, v_cache, scale, out, self._rows(meta, rows))

    def _run_decode_kernel(self, lib, q, k_cache, v_cache, scale: float, out: torch.Tensor, arrays) -> None:
        """The decode kernel over per-row arrays (request, query token, context length; tables; thread split)."""
        row_req, row_token, row_len, tables, bounds, bounds_t = arrays
        head = (
            _ptr(q, _F32P), q.stride(0), q.stride(1),
            _ptr(k_cache, _F32P), _ptr(v_cache, _F32P), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            _ptr(tables, _I32P), tables.stride(0), _ptr(row_req, _I64P), _ptr(row_token, _I64P), _ptr(row_len, _I64P),
        )  # fmt: skip
        tail = (k_cache.shape[2], q.shape[1] // k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
                _ptr(out, _F32P), out.stride(0), out.stride(1))  # fmt: skip
        if hasattr(lib, "paged_decode_parts"):
            lib.paged_decode_parts(*head, _ptr(bounds_t, _I64P), len(bounds) - 1, *tail)
            return
        # A past build (the benchmark's baseline): its row ranges go to Python threads.
        pool = self._threads()
        futures = [pool.submit(lib.paged_decode, *head, a, b, *tail) for a, b in zip(bounds[1:-1], bounds[2:])]
        lib.paged_decode(*head, bounds[0], bounds[1], *tail)
        for f in futures:
            f.result()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(self.num_threads - 1, 1))
        return self._pool

    def _prefill_rows(self, q, k, v, kv_cache, layer_idx, meta, scale, rows: list[int], out: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache.layer(layer_idx)
        lib = self.prefill_kernel or load_prefill_kernel()
        if lib is None or not self._takes_prefill(q, k_cache, out, lib):
            super()._prefill_rows(q, k, v, kv_cache, layer_idx, meta, scale, rows, out)
            return
        req, q_start, q_len, ctx_len, tables = self._prefill_arrays(meta, rows)
        status = lib.paged_prefill(
            _ptr(q, _F32P), q.stride(0), q.stride(1),
            _ptr(k_cache, _F32P), _ptr(v_cache, _F32P), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            _ptr(tables, _I32P), tables.stride(0),
            _ptr(req, _I64P), _ptr(q_start, _I64P), _ptr(q_len, _I64P), _ptr(ctx_len, _I64P), len(rows),
            k_cache.shape[2], q.shape[1] // k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
            _ptr(out, _F32P), out.stride(0), out.stride(1),
        )  # fmt: skip
        if status != 0:  # a thread could not allocate its buffers, before any task ran
            super()._prefill_rows(q, k, v, kv_cache, layer_idx, meta, scale, rows, out)

    def _prefill_arrays(self, meta: AttentionMetadata, rows: list[int]):
        """The prefill kernel's per-request arrays, shared by every layer of the step."""

        def build():
            starts = meta.query_start_loc_cpu
            return (
                torch.tensor(rows, dtype=torch.int64),
                torch.tensor([starts[i] for i in rows], dtype=torch.int64),
                torch.tensor([starts[i + 1] - starts[i] for i in rows], dtype=torch.int64),
                torch.tensor([meta.seq_lens_cpu[i] for i in rows], dtype=torch.int64),
                _contiguous_tables(meta),
            )

        return meta.once_a_step(("cpu", "prefill", tuple(rows)), build)

    def _write_kv(self, k, v, kv_cache: KVCache, layer_idx: int, slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache.layer(layer_idx)
        lib = self.kernel or load_kernel()
        if lib is None or not hasattr(lib, "write_kv_rows") or not _rows_copy(k, v, k_cache, slot_mapping):
            super()._write_kv(k, v, kv_cache, layer_idx, slot_mapping)
            return
        lib.write_kv_rows(
            _ptr(k, _F32P), k.stride(0), _ptr(v, _F32P), v.stride(0), k.shape[0],
            _ptr(slot_mapping, _I64P), _ptr(k_cache, _F32P), _ptr(v_cache, _F32P), k_cache.stride(0), k_cache.stride(1),
            kv_cache.block_size, k.shape[1] * k.shape[2],
        )  # fmt: skip

    def _rows(self, meta: AttentionMetadata, rows: list[int]):
        """The decode kernel's per-row arrays and thread split, shared by every layer of the step."""

        def build():
            lens = [meta.seq_lens_cpu[i] for i in rows]
            bounds = _balanced_bounds(lens, self.num_threads)
            return (
                torch.tensor(rows, dtype=torch.int64),
                torch.tensor([meta.query_start_loc_cpu[i] for i in rows], dtype=torch.int64),
                torch.tensor(lens, dtype=torch.int64),
                _contiguous_tables(meta),
                bounds,
                torch.tensor(bounds, dtype=torch.int64),
            )

        return meta.once_a_step(("cpu", "decode", tuple(rows)), build)

    @staticmethod
    def _takes(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> bool:
        fp32 = q.dtype == k_cache.dtype == out.dtype == torch.float32
        unit = q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
        heads, head_dim = q.shape[1], q.shape[2]
        fits = heads <= MAX_Q_HEADS and heads * head_dim <= MAX_STATE and k_cache.shape[1] <= MAX_BLOCK
        return fp32 and unit and fits

    @staticmethod
    def _takes_prefill(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, lib: ctypes.CDLL) -> bool:
        fp32 = q.dtype == k_cache.dtype == out.dtype == torch.float32
        unit = q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
        group, head_dim = q.shape[1] // k_cache.shape[2], q.shape[2]
        max_group, dim_tile = prefill_limits(lib)
        return fp32 and unit and group <= max_group and head_dim % dim_tile == 0


def _contiguous_tables(meta: AttentionMetadata) -> torch.Tensor:
    return meta.block_tables if meta.block_tables.is_contiguous() else meta.block_tables.contiguous()


def _rows_copy(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether ``write_kv_rows`` takes these: fp32 rows each whole in one run of memory, in the
    source and in a cache slot, and int64 slots."""
    fp32 = k.dtype == v.dtype == k_cache.dtype == torch.float32
    heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v, k_cache[0]))
    slots = slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.device.type == "cpu"
    return fp32 and rows and slots and tuple(k.shape[1:]) == tuple(v.shape[1:]) == (heads, head_dim)


def _balanced_bounds(lens: list[int], parts: int) -> list[int]:
    """Row boundaries of ``parts`` contiguous ranges with about equal total context."""
    total = sum(lens)
    bounds, acc = [0], 0
    for i, n in enumerate(lens):
        acc += n
        if len(bounds) < parts and acc >= total * len(bounds) / parts:
            bounds.append(i + 1)
    while len(bounds) <= parts:
        bounds.append(len(lens))
    bounds[-1] = len(lens)
    return bounds


class BatchInvariantCpuAttention(CpuAttention):
    """Deterministic mode: every query row, a prompt chunk's as much as a decode step's, goes
    through the decode kernel, one row over its own context (its causal prefix), in the same
    order whatever its batch, its chunk or the split of rows among threads."""

    name = "cpu"

    def forward(self, q, k, v, kv_cache: KVCache, layer_idx: int, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        self._write_kv(k, v, kv_cache, layer_idx, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        k_cache, v_cache = kv_cache.layer(layer_idx)
        lib = self.kernel or load_kernel()
        if lib is None or not hasattr(lib, "paged_decode_parts") or not self._takes(q, k_cache, out):
            raise RuntimeError("deterministic mode needs the CPU decode kernel for these heads (checked at start-up)")
        if meta.num_reqs and q.shape[0]:
            self._run_decode_kernel(lib, q, k_cache, v_cache, scale, out, self._token_rows(meta))
        return out

    def _token_rows(self, meta: AttentionMetadata):
        """One kernel row per query token of the step: token t of a chunk of L new tokens over a
        context of C sees C - L + t + 1 keys."""

        def build():
            starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
            req, token, length = [], [], []
            for i in range(meta.num_reqs):
                q_len = starts[i + 1] - starts[i]
                for t in range(q_len):
                    req.append(i)
                    token.append(starts[i] + t)
                    length.append(lens[i] - q_len + t + 1)
            bounds = _balanced_bounds(length, self.num_threads)
            return (torch.tensor(req, dtype=torch.int64), torch.tensor(token, dtype=torch.int64),
                    torch.tensor(length, dtype=torch.int64), _contiguous_tables(meta), bounds,
                    torch.tensor(bounds, dtype=torch.int64))  # fmt: skip

        return meta.once_a_step(("cpu", "tokens"), build)

    def refusal(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
        """Why these heads cannot run deterministically here, or None."""
        lib = self.kernel or load_kernel()
        if lib is None or not hasattr(lib, "paged_decode_parts"):
            return "deterministic mode on the CPU needs its C decode-attention kernel, and no C compiler built it"
        if num_q_heads > MAX_Q_HEADS or num_q_heads * head_dim > MAX_STATE:
            return f"deterministic mode: the CPU decode kernel takes up to {MAX_Q_HEADS} query heads of {MAX_STATE} values"
        return None
