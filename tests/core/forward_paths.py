"""A step's forward two ways from the same starting KV cache: the graph modules' tests compare
an engine path (pieces, whole-step graphs) with the eager forward over the same rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from siesta.core.model_runner import ModelRunner, StepInputs


def dummy_inputs(runner: ModelRunner, specs: list[tuple[int, int]]) -> StepInputs:
    """A step of (cached, new) tokens per request, its KV written, random token ids."""
    return runner._dummy_inputs(specs, runner.kv_cache.num_blocks, writes=True, seed=sum(q for _, q in specs))


def both_paths(runner: ModelRunner, run_step: Callable[[StepInputs], torch.Tensor],
               specs: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(eager hidden, eager cache, ``run_step``'s hidden, its cache) from the same starting cache."""
    cache = runner.kv_cache.tensor
    torch.manual_seed(0)
    start = torch.randn(cache.shape, dtype=torch.float32).to(cache.dtype).to(cache.device)
    inputs = dummy_inputs(runner, specs)
    with torch.inference_mode():
        cache.copy_(start)
        eager = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta).clone()
        eager_cache = cache.clone()
        cache.copy_(start)
        stepped = run_step(inputs).clone()
    return eager, eager_cache, stepped, cache.clone()
