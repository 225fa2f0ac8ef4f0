"""Every Triton kernel compiles for the H100/H200 (sm_90), checked on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1, how the CPU tests run the kernels) is
Python: it accepts code the compiler rejects, e.g. a name bound to tensors of
two shapes in the two arms of an ``if``. So the host wrappers are called here
with real shapes (Llama-3-8B heads, bf16 and fp32) while launches are recorded
instead of run, and a subprocess without the interpreter compiles each recorded
launch down to a cubin with Triton's own compiler and ptxas.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
    pytest.skip("records launches through the interpreter (CPU runs); a GPU compiles them anyway",
                allow_module_level=True)  # fmt: skip

from siesta.attention import triton_attention  # noqa: E402
from siesta.attention.base import AttentionMetadata, KVCache  # noqa: E402
from siesta.attention.triton_attention import TritonAttention  # noqa: E402
from siesta.model import (  # noqa: E402
    l2_prefetch,
    triton_align,
    triton_gemv,
    triton_matmul,
    triton_moe,
    triton_ops,
    triton_router,
)

KERNEL_MODULES = ("siesta.attention.triton_kernels", "siesta.attention.triton_kv_write", "siesta.model.triton_ops",
                  "siesta.model.triton_matmul", "siesta.model.triton_align", "siesta.model.triton_router",
                  "siesta.model.triton_gemv", "siesta.model.l2_prefetch", "siesta.model.triton_moe")  # fmt: skip
# Host choices that differ on CUDA from a CPU call: compile what the GPU runs.
CUDA_CONSTEXPRS = {"MEAN_BY_DIVISION": False, "USE_LIBDEVICE": True, "BY_ASM": True}
TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
                torch.float8_e5m2: "fp8e5"}  # fmt: skip
# Llama-3-8B attention: 32 query heads over 8 KV heads of 128.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    annotation = parameter.annotation
    return annotation is triton.language.constexpr or annotation in ("tl.constexpr", "triton.language.constexpr")


def _describe(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> dict:
    """A launch as (module, name, signature, constexprs, options), all JSON."""
    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for name, value in bound.items():
        if _is_constexpr(params[name]):
            signature[name] = "constexpr"
            constexprs[name] = CUDA_CONSTEXPRS.get(name, value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot describe argument {name}={value!r}")
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return {"module": kernel.fn.__module__, "name": kernel.fn.__name__, "signature": signature,
            "constexprs": constexprs, "options": options}  # fmt: skip


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    recorded: list[dict] = []

    def record(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__ in KERNEL_MODULES:
            recorded.append(_describe(self, args, kwargs))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    return recorded


@contextlib.contextmanager
def _setting(module, name: str, value) -> Iterator[None]:
    """``module.name`` set to ``value``, the shipped value back after."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _batch(specs: list[tuple[int, int]], dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v, cache and metadata for requests of (cached, new) tokens; contents do not matter."""
    seq_lens = [c + n for c, n in specs]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_tokens = sum(n for _, n in specs)
    cache = KVCache.allocate(sum(blocks), 1, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype, torch.device("cpu"))
    tables = torch.zeros(len(specs), max(blocks), dtype=torch.int32)
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    q = torch.empty(num_tokens, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.empty(num_tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    return q, k, k.clone(), cache, meta


def _call_every_attention_kernel(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    mixed = [(19456, 44), (0, 300), (4000, 1), (700, 1)]
    decode = [(4000, 1), (30000, 1)]
    for backend, specs in (
        (TritonAttention(prefill_splits=1, mixed_decode_min_splits=None), mixed),  # one unified launch
        (TritonAttention(prefill_splits=1), mixed),  # unified launch, decode rows split apart
        (TritonAttention(prefill_splits=8), mixed),  # split prefill tiles + per-token merge
        (TritonAttention(decode_splits=1), decode),  # decode, unsplit
        (TritonAttention(), decode),  # decode, split + merge
    ):
        q, k, v, cache, meta = _batch(specs, dtype, kv_dtype)
        backend.forward(q, k, v, cache, 0, meta, HEAD_DIM**-0.5)
    # Decode-only steps whose split kernel stores the new K/V itself, and whose write kernel does, unsplit and split.
    for fused in (True, False):
        with _setting(triton_attention, "FUSE_DECODE_KV_WRITE", fused):
            for backend in (TritonAttention(decode_splits=1), TritonAttention()):
                q, k, v, cache, meta = _batch(decode, dtype, kv_dtype)
                backend.forward(q, k, v, cache, 0, meta, HEAD_DIM**-0.5)
    # Split decode whose last program to finish merges the splits (the arrival count's atomics).
    with _setting(triton_attention, "FUSE_DECODE_MERGE", True):
        q, k, v, cache, meta = _batch(decode, dtype, kv_dtype)
        TritonAttention().forward(q, k, v, cache, 0, meta, HEAD_DIM**-0.5)


def _call_every_kernel(dtype: torch.dtype) -> None:
    _call_every_attention_kernel(dtype, dtype)
    x = torch.empty(4, 4096, dtype=dtype)
    w = torch.empty(4096, dtype=dtype)
    triton_ops.rms_norm(x, w, 1e-5)
    triton_ops.fused_add_rms_norm(x, x.clone(), w, 1e-5)
    triton_ops.rms_norm(torch.empty(4, KV_HEADS, HEAD_DIM, dtype=dtype), torch.empty(HEAD_DIM, dtype=dtype), 1e-6)
    triton_ops.silu_and_mul(torch.empty(4, 2 * 14336, dtype=dtype))
    cos = torch.empty(64, HEAD_DIM, dtype=torch.float32)
    triton_ops.apply_rope(torch.empty(4, HEADS, HEAD_DIM, dtype=dtype), torch.empty(4, KV_HEADS, HEAD_DIM, dtype=dtype),
                          torch.zeros(4, dtype=torch.int64), cos, cos.clone())  # fmt: skip
    # Qwen3's q/k norm and rotation: all q heads in one program, and split over programs.
    for per_program in (None, 8):
        with _setting(triton_ops, "QK_NORM_Q_HEADS_PER_PROGRAM", per_program):
            triton_ops.qk_norm_rope(torch.empty(4, HEADS, HEAD_DIM, dtype=dtype),
                                    torch.empty(4, KV_HEADS, HEAD_DIM, dtype=dtype), torch.zeros(4, dtype=torch.int64),
                                    cos, cos.clone(), torch.empty(HEAD_DIM, dtype=dtype),
                                    torch.empty(HEAD_DIM, dtype=dtype), 1e-6, 1e-6)  # fmt: skip
    # A decode step's MoE pieces (Qwen3-30B-A3B: 128 experts, top 8): the router's tail on 4 warps
    # and on 1, the pairs' placement at 64 tokens, the one-row GEMV and its split-K merge.
    logits = torch.empty(64, 128, dtype=dtype)
    for warps in (4, 1):
        with _setting(triton_router, "ROUTE_NUM_WARPS", warps):
            triton_router.route(logits, 8, True, dtype)
    triton_align.align_pairs(torch.zeros(64 * 8, dtype=torch.int64), 128, 16, 64 * 8 // 16 + 128)
    x1, router = torch.empty(1, 2048, dtype=dtype), torch.empty(128, 2048, dtype=dtype)
    triton_router.linear_route(x1, router, 8, True, dtype)  # one token's logits and tail in one launch
    triton_gemv.gemv(x1, router)
    # every per-matrix one-row config the table ships (2-byte weights), and the rule's for the rest
    if dtype.itemsize == 2:
        for n, k in triton_gemv.ONE_ROW_SHAPES:
            triton_gemv.gemv(torch.empty(1, k, dtype=dtype), torch.empty(n, k, dtype=dtype))
    triton_gemv.gemv(x1, torch.empty(256, 2048, dtype=dtype))
    triton_gemv.gemv(torch.empty(1, 1000, dtype=dtype), torch.empty(300, 1000, dtype=dtype))  # a ragged last K chunk
    triton_gemv.gemv(x1, router, config=triton_gemv.GemvConfig(4, 512, 4, 3, split_k=4))
    # A layer's input norm folded into its q/k/v GEMV: Qwen3-30B-A3B's (a table config) and Llama-3-8B's (with bias).
    for k, n in ((2048, 5120), (4096, 6144)):
        h, w = torch.empty(1, k, dtype=dtype), torch.empty(k, dtype=dtype)
        triton_gemv.add_norm_gemv(h, h.clone(), w, 1e-6, torch.empty(n, k, dtype=dtype), torch.empty(n, dtype=dtype), 1 / k)
    # One token's experts (Qwen3-30B-A3B's shapes, 16 experts stand in for 128): gate/up a pair,
    # then down-and-sum a token, or split over its experts with the last to arrive summing.
    if dtype.itemsize == 2:
        x1, ids = torch.empty(1, 2048, dtype=dtype), torch.arange(8).view(1, 8)
        experts = (torch.empty(16, 2 * 768, 2048, dtype=dtype), torch.empty(16, 2048, 768, dtype=dtype))
        ragged = (torch.empty(16, 2 * 700, 2048, dtype=dtype), torch.empty(16, 2048, 700, dtype=dtype))  # I = 700
        for split in (False, True):
            with _setting(triton_moe, "DOWN_SUM_SPLIT", split):
                for gate_up, down in (experts, ragged):
                    triton_moe._fused_moe_pairs(x1, torch.empty(1, 8, dtype=dtype), ids, gate_up, down)
    # L2 prefetches of an o_proj (normal priority) and a q/k/v projection (evict_last): the PTX.
    for evict_last in (False, True):
        l2_prefetch.prefetch(torch.empty(2048, 4096, dtype=dtype), evict_last)
    # Deterministic mode's GEMM: K a multiple of the chunk without bias (o_proj), and neither (a ragged K, q/k/v bias).
    triton_matmul.matmul(torch.empty(4, 4096, dtype=dtype), torch.empty(4096, 4096, dtype=dtype))
    ragged = torch.empty(300, 1000, dtype=dtype)
    triton_matmul.matmul(torch.empty(4, 1000, dtype=dtype), ragged, torch.empty(300, dtype=dtype))


COMPILER = textwrap.dedent(
    """
    import importlib, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for launch in json.load(sys.stdin):
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        src = ASTSource(fn, launch["signature"], constexprs=launch["constexprs"])
        try:
            triton.compile(src, target=GPUTarget(*TARGET), options=launch["options"])
        except Exception as e:
            failures.append(f"{launch['name']} {launch['constexprs']}: {type(e).__name__}: {e}")
    print(json.dumps(failures))
    """
).replace("TARGET", repr(TARGET))


def test_every_kernel_compiles_for_sm90(launches: list[dict]) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        _call_every_kernel(dtype)
    # fp8 KV caches: the write kernel quantizes, the attention kernels dequantize in registers.
    for dtype, kv_dtype in ((torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float8_e4m3fn),
                            (torch.bfloat16, torch.float8_e5m2)):  # fmt: skip
        _call_every_attention_kernel(dtype, kv_dtype)
    names = {launch["name"] for launch in launches}
    expected = {"unified_kernel", "prefill_split_kernel", "decode_split_kernel", "reduce_splits_kernel",
                "_write_kv_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_kernel",
                "_matmul_kernel", "_qk_norm_rope_kernel", "_route_kernel", "_align_kernel", "_gemv_kernel",
                "_split_k_reduce_kernel", "_prefetch_kernel", "_gate_up_pair_kernel", "_down_sum_kernel",
                "_down_pair_kernel", "_linear_route_kernel", "_add_norm_gemv_kernel"}  # fmt: skip
    assert expected <= names, f"not launched: {expected - names}"
    unique = list({json.dumps(launch, sort_keys=True): launch for launch in launches}.values())
    env = os.environ | {"TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILER], input=json.dumps(unique), capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)
