"""Virtual-memory arenas on CUDA: pages released and re-mapped at the same addresses.

These need a GPU and cuda-python; ``bash bench/gpu.sh`` runs them on the H200
before the benchmark (CPU CI has neither: the CPU path is the storage-resize
sleep, tested in test_engine_control.py).
"""

from __future__ import annotations

import pytest
import torch

from siesta.core.vmm import VirtualArena, place_parameters, vmm_available

pytestmark = pytest.mark.skipif(not vmm_available(), reason="needs CUDA and cuda-python (run by bench/gpu.sh)")

MiB = 1 << 20


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_unmap_returns_the_memory_and_map_keeps_the_address() -> None:
    arena = VirtualArena(1536 * MiB, torch.device("cuda"))
    t = arena.tensor
    ptr = t.data_ptr()
    t.view(torch.float32).fill_(3.0)
    free_mapped = _free()
    arena.unmap()
    freed = _free() - free_mapped
    assert freed >= 1536 * MiB, f"unmap freed only {freed / MiB:.0f} MiB"
    arena.map()
    assert t.data_ptr() == ptr == arena.address
    assert _free() <= free_mapped + 64 * MiB  # the pages came back
    t.view(torch.float32).fill_(5.0)
    assert torch.all(t.view(torch.float32) == 5.0)
    free_before_drop = _free()
    del arena
    assert _free() == free_before_drop, "a live view must keep the pages"
    del t
    assert _free() - free_before_drop >= 1536 * MiB, "dropping the last view must free the pages"


def test_a_captured_graph_survives_unmap_and_map() -> None:
    arena = VirtualArena(8 * MiB, torch.device("cuda"))
    w = arena.tensor[: 4 * MiB].view(torch.float32).view(1024, 1024)
    x = arena.tensor[4 * MiB : 4 * MiB + 4096 * 4].view(torch.float32).view(4, 1024)
    torch.manual_seed(0)
    w.copy_(torch.randn(1024, 1024, device="cuda"))
    x.copy_(torch.randn(4, 1024, device="cuda"))
    backup = arena.tensor.cpu()
    expected = x @ w
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = x @ w
    arena.unmap()
    arena.map()
    arena.tensor.copy_(backup)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)


def test_place_parameters_keeps_ties_and_outputs() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.proj = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.proj(self.embed(ids)))

    torch.manual_seed(1)
    reference = Tied().cuda()
    with torch.device("meta"):
        model = Tied()
    arena = place_parameters(model, torch.device("cuda"))
    assert model.head.weight is model.embed.weight
    model.load_state_dict(reference.state_dict())
    for p in model.parameters():
        start = p.data_ptr() - arena.address
        assert 0 <= start and start + p.numel() * p.element_size() <= arena.nbytes
    ids = torch.arange(10, device="cuda")
    torch.testing.assert_close(model(ids), reference(ids))


def test_engine_sleep_keeps_graphs_and_greedy_output() -> None:
    from siesta import LLM, SamplingParams

    llm = LLM("random:tiny-llama", dtype="bfloat16", max_model_len=512, kv_cache_bytes=256 * MiB, device="cuda")
    runner = llm.engine.runner
    assert runner.weight_arena is not None and runner.kv_arena is not None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 60 + 3 * i))} for i in range(4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = dict(runner.graphs.graphs)
    assert graphs, "decode ran without CUDA graphs"
    engine_bytes = llm.engine.memory.weight_bytes + llm.engine.memory.kv_bytes
    free_awake = _free()
    llm.sleep(level=1)
    assert _free() - free_awake >= 0.95 * engine_bytes
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
    assert all(runner.graphs.graphs[b] is g for b, g in graphs.items()), "graphs were recaptured"


def test_level2_sleep_then_weights_from_a_state_dict() -> None:
    from siesta import LLM, SamplingParams

    llm = LLM("random:tiny-qwen3", dtype="bfloat16", max_model_len=512, kv_cache_bytes=256 * MiB, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 90))}
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    state = {k: v.detach().cpu().clone() for k, v in llm.engine.source.iter_weights(torch.bfloat16, "cpu")}
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.update_weights(state.items(), weight_version=llm.engine.weight_version)
    llm.wake_up(tags=["kv_cache"])
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("keep_tier", [False, True])
def test_woken_pages_of_nan_bits_are_zeroed_on_the_device_as_steps_use_them(keep_tier: bool) -> None:
    # The CUDA side of test_engine_control's NaN test: re-mapped pages poisoned with NaN, the
    # zeroing done by index_fill_ over a bf16 cache with graphs on, and tier loads left alone.
    from siesta import LLM, SamplingParams

    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * MiB}}  # fmt: skip
    llm = LLM("random:tiny-llama", dtype="bfloat16", max_model_len=512, kv_cache_bytes=64 * MiB, device="cuda",
              kv_transfer_config=tier)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(7 + i, 80 + 40 * i))} for i in range(3)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.sleep(level=1, clear_connector_cache=not keep_tier)
    llm.wake_up()
    kv = llm.engine.runner.kv_cache
    kv.tensor.fill_(float("nan"))
    load_bytes = 'siesta_kv_offload_load_bytes_total{tier="host"}'
    loaded_before = llm.get_metrics().get(load_bytes, 0.0)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
    assert (llm.get_metrics().get(load_bytes, 0.0) > loaded_before) == keep_tier
    used = torch.from_numpy(~kv.unset).to(kv.tensor.device)
    assert 0 < int(used.sum()) < kv.num_blocks
    assert torch.isfinite(kv.tensor[used]).all()
