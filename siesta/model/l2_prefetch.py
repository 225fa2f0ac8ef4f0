"""Decode weights prefetched into the GPU's L2 on a side stream, while the step's latency-bound
kernels leave HBM idle.

At a few rows a decode step is a chain of weight streams (the GEMVs, the experts) with small
kernels between them that read almost nothing: q/k norm and RoPE, attention over a short cache,
its merge, the norms, the router's tail. H200 run 63a's Qwen3-30B-A3B batch-1 step spent 0.9 of
its 3.15 ms in those, with the memory system nearly idle, and then started each GEMV cold. Here
a side stream forked off the step issues L2 prefetches for the weights a later kernel streams:

- ``o_proj``: during attention (after the q/k/v projection), the layer's o_proj (16.8 MB for
  Qwen3-30B-A3B, 32 MB for Llama-3-8B; L2 is 50 MB on an H100 or H200), fetched with the
  normal eviction priority: it is read some 10 µs later.
- ``next_qkv``: after o_proj, before the MLP, the next layer's q/k/v projection, marked
  ``evict_last`` so that it outlives the MLP's (or the experts') stream, which is read once.

At most ``MAX_BYTES`` of a tensor (its leading rows, the ones the GEMV's first programs read) are
prefetched. A prefetch is a hint: nothing is read into registers and nothing is written, so no
result depends on it, and the side stream needs no join before the weight's reader. It joins the
step once at the end of the forward, which CUDA graph capture requires; the piecewise graphs'
pieces never fork (they call the layer's halves, not its ``forward``). Prefetches go into CUDA
graphs (and a device's first eager step, which loads the kernel before any capture): an eager
step would pay two Triton launches a layer on the host. Others measured
the same idea on other cards: +7 % batch-1 decode steps with ``cp.async.bulk.prefetch.L2`` on an
RTX PRO 6000 (a vLLM fork's GLM-5 path), +3.7 % with ``prefetch.global.L2`` on an RTX 5090.

Off (``MAX_ROWS = 0``) until a card measures it: the ``moe`` bench's ``knobs`` part has the arms.
On the CPU there is no L2 to fill and nothing forks; the kernel's address walk runs under the
interpreter by loading each line's first byte instead (``BY_ASM`` false), which the tests sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import nn

# Decode steps of at most this many rows prefetch (0: none), in the graphs captured from then on.
# The knobs bench sets it per arm.
MAX_ROWS = 0
# The windows used, of ``WINDOWS``.
ENABLED: tuple[str, ...] = ("o_proj", "next_qkv")
WINDOWS = ("o_proj", "next_qkv")
# Most bytes of one tensor prefetched: both windows' fills together stay within the 50 MB L2
# of an H100 / H200 with room for what the step keeps there.
MAX_BYTES = 24 << 20
LINE_BYTES = 128  # an L2 line
LINES_PER_ITERATION = 1024  # a program's prefetches a loop step (8 a thread on 4 warps)
PROGRAMS = 16  # few SMs: prefetches take no registers, the memory system queues them
NUM_WARPS = 4
# prefetch.global.L2::evict_last came with compute capability 8.0.
MIN_CAPABILITY = 8


@triton.jit
def _prefetch_kernel(base_ptr, lines, sums_ptr, LINE: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr,
                     BY_ASM: tl.constexpr):  # fmt: skip
    """Program p walks lines p * BLOCK, p * BLOCK + programs * BLOCK, ... of the ``lines`` lines
    of ``LINE`` bytes from ``base_ptr`` (bytes). ``BY_ASM``: an L2 prefetch of each; otherwise
    (the interpreter) the sum of each line's first byte, stored at ``sums_ptr[p]``."""
    pid = tl.program_id(0)
    total = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(pid * BLOCK, lines, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < lines
        if BY_ASM:  # past the end: the last line again, not an address outside the tensor
            ptrs = base_ptr + tl.where(valid, offs, lines - 1).to(tl.int64) * LINE
            if EVICT_LAST:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        else:
            total += tl.load(base_ptr + offs.to(tl.int64) * LINE, mask=valid, other=0).to(tl.int32)
    if not BY_ASM:
        tl.store(sums_ptr + pid, tl.sum(total))


def prefetch(weight: torch.Tensor, evict_last: bool, max_bytes: int = MAX_BYTES,
             programs: int = PROGRAMS) -> torch.Tensor | None:  # fmt: skip
    """Prefetch the first ``max_bytes`` of the contiguous ``weight`` into L2 on the current
    stream (CUDA). Elsewhere the interpreter's walk: returns each program's sum of the first
    byte of the lines it took."""
    data = weight.detach().view(-1).view(torch.uint8)[:max_bytes]
    lines = triton.cdiv(data.numel(), LINE_BYTES)
    by_asm = data.is_cuda
    sums = None if by_asm else torch.zeros(programs, dtype=torch.int32, device=data.device)
    if lines:
        _prefetch_kernel[(programs,)](data, lines, data if sums is None else sums, LINE=LINE_BYTES,
                                      BLOCK=LINES_PER_ITERATION, EVICT_LAST=evict_last, BY_ASM=by_asm,
                                      num_warps=NUM_WARPS)  # fmt: skip
    return sums


class Prefetches:
    """What a forward's layers call at each window; this one issues nothing (the CPU, larger
    steps, the knob off)."""

    def during_attention(self, layer: int) -> None:
        pass

    def before_mlp(self, layer: int) -> None:
        pass

    def join(self) -> None:
        pass


NO_PREFETCH = Prefetches()


class StepPrefetch(Prefetches):
    """One forward's prefetches over ``layers`` (decoder layers: ``self_attn.o_proj`` and
    ``self_attn.qkv_proj``), issued on ``stream`` after what the step has queued so far."""

    def __init__(self, layers: Sequence[nn.Module], stream: torch.cuda.Stream, windows: tuple[str, ...]) -> None:
        self.layers, self.stream, self.windows = layers, stream, windows
        self.forked = False

    def during_attention(self, layer: int) -> None:
        if "o_proj" in self.windows:
            self._issue(self.layers[layer].self_attn.o_proj.weight, evict_last=False)

    def before_mlp(self, layer: int) -> None:
        if "next_qkv" in self.windows and layer + 1 < len(self.layers):
            self._issue(self.layers[layer + 1].self_attn.qkv_proj.weight, evict_last=True)

    def _issue(self, weight: torch.Tensor, evict_last: bool) -> None:
        if not weight.is_contiguous():  # a view of rows (none today): its bytes are not one run
            return
        self.stream.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(self.stream):
            prefetch(weight, evict_last)
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.forked = False


def wanted(rows: int, device: torch.device) -> bool:
    """Whether a step of ``rows`` rows on ``device`` may prefetch (``for_step`` adds: only into a
    CUDA graph being captured)."""
    return 0 < rows <= MAX_ROWS and bool(ENABLED) and device.type == "cuda" and _capable(device)


def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= MIN_CAPABILITY


_side_streams: dict[int, torch.cuda.Stream] = {}
_warmed: set[int] = set()  # devices whose first eager step has prefetched (the kernel is loaded)


def _side_stream(index: int) -> torch.cuda.Stream | None:
    """The device's prefetch stream; made only outside a capture, where creating one is safe."""
    if index not in _side_streams and not torch.cuda.is_current_stream_capturing():
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams.get(index)


def for_step(layers: Sequence[nn.Module], rows: int, device: torch.device) -> Prefetches:
    """The prefetches of a forward of ``rows`` rows over ``layers``: none unless ``wanted``, and
    into a CUDA graph being captured (replayed at no host cost), not into eager steps, which would
    pay two Triton launches a layer on the host, more than a small step's prefetches could win;
    but for a device's first eager step, the graphs' warm-up, which makes the side stream and
    compiles the kernel outside any capture."""
    if not wanted(rows, device):
        return NO_PREFETCH
    unknown = set(ENABLED) - set(WINDOWS)
    if unknown:
        raise ValueError(f"l2_prefetch.ENABLED: unknown windows {sorted(unknown)}; they are {WINDOWS}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_stream(index)
    if stream is None:
        return NO_PREFETCH
    if not torch.cuda.is_current_stream_capturing():
        # Eager: only the device's first such step, so that the kernel is compiled and its module
        # loaded before a capture launches it (the graphs' warm-up runs that step).
        if index in _warmed:
            return NO_PREFETCH
        _warmed.add(index)
    return StepPrefetch(layers, stream, tuple(ENABLED))
