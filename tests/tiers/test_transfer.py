"""Block copies between the KV cache and host buffers: runs, round trips, both CUDA issue paths."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from siesta.attention.base import KVCache
from siesta.tiers.transfer import BlockCopier, block_runs

# (device, threaded): CPU copies synchronously; CUDA batches, or issues from a thread.
PATHS = [("cpu", False)] + ([("cuda", False), ("cuda", True)] if torch.cuda.is_available() else [])


def test_block_runs_merge_consecutive_ids_only() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 9, 10, 2, 3, 3]) == [(0, 4, 3), (3, 9, 2), (5, 2, 2), (7, 3, 1)]
    assert block_runs([7, 6, 5]) == [(0, 7, 1), (1, 6, 1), (2, 5, 1)]


def _cache(device: str, num_blocks: int = 40) -> KVCache:
    kv = KVCache.allocate(num_blocks, 2, 4, 2, 8, torch.float16, torch.device(device))
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(0)).to(kv.tensor))
    return kv


def _copier(device: str, threaded: bool) -> BlockCopier:
    copier = BlockCopier(torch.device(device))
    if threaded and copier.cuda:  # force the one-by-one path, as without cuda-python
        copier._batch = None
        copier._issuer = ThreadPoolExecutor(max_workers=1)
    return copier


@pytest.mark.parametrize(("device", "threaded"), PATHS)
@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 7, 8], [30, 2, 17, 5, 6, 11], [0, 39, 1, 38]])
def test_store_then_load_round_trips(device: str, threaded: bool, ids: list[int]) -> None:
    kv = _cache(device)
    copier = _copier(device, threaded)
    host = torch.empty((len(ids), *kv.tensor.shape[1:]), dtype=kv.tensor.dtype, pin_memory=device == "cuda")
    handle = copier.store(kv, ids, host)
    copier.wait(handle)
    assert copier.done(handle)
    assert torch.equal(host, kv.tensor[ids].cpu())
    # Load into other blocks, split over two pieces with one handle.
    targets = [t for t in range(40) if t not in ids][: len(ids)]
    half = len(ids) // 2
    handle = copier.load([(host[:half], targets[:half]), (host[half:], targets[half:])], kv)
    copier.wait(handle)
    assert torch.equal(kv.tensor[targets].cpu(), host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_copier_batches_when_the_driver_can() -> None:
    try:
        from cuda.bindings import driver
    except ImportError:
        pytest.skip("cuda-python is not installed")
    assert BlockCopier(torch.device("cuda")).batched == hasattr(driver, "cuMemcpyBatchAsync")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_store_waits_for_the_forward_that_fills_its_blocks() -> None:
    kv = _cache("cuda")
    copier = BlockCopier(torch.device("cuda"))
    host = torch.empty((4, *kv.tensor.shape[1:]), dtype=kv.tensor.dtype, pin_memory=True)
    torch.cuda._sleep(50_000_000)  # a long kernel ahead on the compute stream...
    kv.tensor[10:14].fill_(7.0)  # ...then the write the store must see
    copier.wait(copier.store(kv, [10, 11, 12, 13], host))
    assert torch.all(host == 7.0)
