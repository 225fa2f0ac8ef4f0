"""ModelRunner: the kernel warm-up reaches every attention path and writes nothing."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from siesta import LLM  # noqa: E402

ATTENTION_KERNELS = {"_unified_kernel", "_prefill_split_kernel", "_decode_split_kernel", "_reduce_splits_kernel"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts launches through the interpreter (CPU runs)")
def test_kernel_warm_up_reaches_every_attention_path_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model="random:tiny-llama", dtype="float32", attention_backend="triton", max_model_len=1024,
              kv_cache_bytes=8 << 20)  # fmt: skip
    runner = llm.engine.runner
    launched: set[str] = set()
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launched.add(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    runner.kv_cache.tensor.normal_()
    before = runner.kv_cache.tensor.clone()
    runner._warm_up_kernels()
    assert ATTENTION_KERNELS <= launched, f"not reached: {ATTENTION_KERNELS - launched}"
    assert torch.equal(runner.kv_cache.tensor, before), "warm-up writes went to real slots"
