"""Programmatic dependent launch (PDL) for siesta's decode-path Triton kernels, Hopper and later.

Without it, a kernel on a stream starts only once the kernel before it has finished and its
writes are flushed: a decode step of small kernels pays that gap hundreds of times, inside a CUDA
graph too (a Qwen3-30B-A3B batch-1 step: 592 launches, 0.25 ms of its 3.96 idle between them and
each small kernel's ramp on top, H100 run 54a). A kernel launched with PDL may instead be
scheduled while its predecessor finishes: its launch is processed ahead and its programs start
as soon as the predecessor's have all exited.

The rule every kernel here keeps, so that nothing can race: its first act is
``griddepcontrol.wait``, which returns once the previous grid on the stream has completed and its
memory is visible. No program reads or writes anything before everything before it on the stream
is done, as without PDL; only the scheduling overlaps. A kernel that does not take part (torch's,
cuBLAS's) waits as it always did, and one that takes part after it starts after it. CUDA graphs
keep the launch attribute as programmatic edges.

No kernel calls ``griddepcontrol.launch_dependents`` early: with it right after the wait, the next
kernel's programs sat resident on the SMs while this one's still ran, and a Qwen3-30B-A3B
batch-1 step took 4.39 ms against 3.89 without PDL (H100 run 58b). With the wait alone the step
takes 3.78-3.79 ms against 3.90 (1.03x, runs 58c-d, arms alternated on one engine), batch 16 and
64 even, and the tokens and logprobs are the same bits (``tests/test_pdl.py`` on the H100).

On by default (``EngineConfig.programmatic_dependent_launch``; ``SIESTA_PDL=0`` turns it off);
on the CPU, and on CUDA cards before Hopper, it is always off (the interpreter has no such
instructions).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# griddepcontrol came with compute capability 9.0 (Hopper).
MIN_CAPABILITY = 9

_enabled = False  # until an engine sets it from its config


def set_enabled(on: bool) -> None:
    """PDL for the kernels launched from now on in this process (graphs captured before keep theirs)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= MIN_CAPABILITY


def supported(device: torch.device) -> bool:
    """Whether ``device`` has the instructions (a CUDA card of compute capability 9.0 or later)."""
    if device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def active(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` take part now."""
    return _enabled and supported(device)


def launch(device: torch.device) -> dict[str, bool]:
    """The keyword arguments of a taking-part kernel's launch: its ``USE_PDL`` and Triton's
    ``launch_pdl`` (the launch attribute)."""
    on = active(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous_grid(USE_PDL: tl.constexpr):
    """A taking-part kernel's first statement: wait until the previous grid has completed."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
