"""ModelRunner: the kernel warm-up reaches every attention path and writes nothing; the CPU pool is
written at start-up only when asked."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from siesta import LLM  # noqa: E402
from memory import resident_bytes  # noqa: E402

ATTENTION_KERNELS = {"unified_kernel", "prefill_split_kernel", "decode_split_kernel", "reduce_splits_kernel"}


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


@pytest.mark.parametrize("prefault", [False, True])
def test_a_cpu_engine_writes_its_kv_pool_at_start_up_only_when_asked(prefault: bool) -> None:
    pool_bytes = 32 << 20
    llm = LLM(model="random:tiny-llama", dtype="float32", device="cpu", max_model_len=1024, kv_cache_bytes=pool_bytes,
              prefault_kv_cache=prefault)  # fmt: skip
    kv = llm.engine.runner.kv_cache
    nbytes = kv.num_blocks * kv.block_bytes
    resident = resident_bytes(kv.tensor.data_ptr())
    assert resident == nbytes if prefault else resident < nbytes // 8
