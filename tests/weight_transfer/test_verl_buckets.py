"""verl's IPC bucket protocol into SGLang's serialized tensors: the views the engine opens hold the
trainer's tensors byte for byte, and nothing in the trainer's pickles runs but torch's rebuilds."""

from __future__ import annotations

import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from siesta.weight_transfer.pickled_tensors import SerializedTensors
from siesta.weight_transfer.verl_buckets import Bucket, SharedBuffer, serialized_entry
from siesta.weight_transfer.wire import WeightTransferError


@pytest.fixture
def file_system_sharing():
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


def test_a_bucket_opens_as_the_trainers_tensors(file_system_sharing):
    weights = {"a.weight": torch.randn(4, 8), "b.bias": torch.randn(8).to(torch.bfloat16), "c": torch.randn(3)}
    buffer = torch.zeros(4096, dtype=torch.uint8).share_memory_()
    meta, offset = {}, 0
    for name, w in weights.items():
        meta[name] = {"name": name, "shape": w.shape, "dtype": w.dtype, "offset": offset}
        buffer[offset : offset + w.nbytes].copy_(w.view(-1).view(torch.uint8))
        offset += w.nbytes
    handle = SharedBuffer.parse(bytes(ForkingPickler.dumps(reduce_tensor(buffer))))
    assert handle.nbytes == 4096
    bucket = Bucket.parse(pickle.dumps({"bucket_meta": meta, "is_last": True}))
    opened = dict(SerializedTensors(torch.device("cpu")).decode(serialized_entry(handle, bucket), None))
    assert opened.keys() == weights.keys()
    for name, w in weights.items():
        assert opened[name].dtype == w.dtype and torch.equal(opened[name], w)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_foreign_pickles_and_misfits_are_refused_before_anything_runs(file_system_sharing):
    with pytest.raises(WeightTransferError, match="posix.system|os.system"):
        SharedBuffer.parse(pickle.dumps(_Evil()))
    with pytest.raises(WeightTransferError, match="sizes and dtypes only"):
        Bucket.parse(pickle.dumps({"bucket_meta": {"x": {"shape": [1], "dtype": _Evil(), "offset": 0}}}))
    buffer = torch.zeros(64, dtype=torch.uint8).share_memory_()
    handle = SharedBuffer.parse(bytes(ForkingPickler.dumps(reduce_tensor(buffer))))
    with pytest.raises(WeightTransferError, match="does not lie, aligned"):
        handle.view(torch.float32, (4,), 2)  # unaligned
    with pytest.raises(WeightTransferError, match="does not lie, aligned"):
        handle.view(torch.float32, (32,), 0)  # past the bucket
