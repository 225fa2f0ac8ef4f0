"""Opening shared buffers: only torch's rebuild types unpickle, only /dev/shm files open,
and a handle that reaches past its buffer is refused."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from siesta.weight_transfer.handles import HandleOpener, shm_handle, unpickle_handles
from siesta.weight_transfer.wire import WeightTransferError


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/siesta-pwned",))


def test_a_pickle_naming_anything_but_torch_rebuild_types_is_refused():
    data = base64.b64encode(pickle.dumps([Exploit()])).decode()
    with pytest.raises(WeightTransferError, match="names posix.system|names os.system"):
        unpickle_handles(data)
    assert not os.path.exists("/tmp/siesta-pwned")


def test_plain_data_and_torch_dtypes_unpickle():
    data = base64.b64encode(pickle.dumps([{"uuid": (torch.Size([2, 3]), torch.bfloat16, b"\x00", 7)}])).decode()
    assert unpickle_handles(data) == [{"uuid": (torch.Size([2, 3]), torch.bfloat16, b"\x00", 7)}]


def test_garbage_is_a_clear_error():
    with pytest.raises(WeightTransferError, match="not base64"):
        unpickle_handles("%%%")
    with pytest.raises(WeightTransferError, match="does not decode"):
        unpickle_handles(base64.b64encode(b"not a pickle").decode())


@pytest.fixture
def shm_file():
    path = f"/dev/shm/siesta-test-{os.getpid()}"
    data = torch.arange(16, dtype=torch.float32)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    yield path, data
    os.unlink(path)


def test_a_shared_memory_handle_maps_the_trainers_bytes(shm_file):
    path, data = shm_file
    opener = HandleOpener(torch.device("cpu"))
    view = opener.open(shm_handle(path, 8, 16))
    assert torch.equal(view.view(torch.float32), data[2:6])
    with open(path, "r+b") as f:  # the trainer writes the next push into the same file
        f.seek(8)
        f.write(torch.full((4,), 9.0).numpy().tobytes())
    assert torch.equal(opener.open(shm_handle(path, 8, 16)).view(torch.float32), torch.full((4,), 9.0))


def test_shared_memory_handles_outside_dev_shm_or_past_the_end_are_refused(shm_file, tmp_path):
    path, _ = shm_file
    opener = HandleOpener(torch.device("cpu"))
    with pytest.raises(WeightTransferError, match="reaches byte 72 of .* which holds 64"):
        opener.open(shm_handle(path, 8, 64))
    for bad in ("/etc/passwd", str(tmp_path / "w"), "/dev/shm/../etc/passwd"):
        with pytest.raises(WeightTransferError, match="directly under /dev/shm"):
            opener.open(shm_handle(bad, 0, 4))
    with pytest.raises(WeightTransferError, match="'nbytes' must be a non-negative integer"):
        opener.open({"shm": path, "offset": 0, "nbytes": -1})


def test_a_cpu_engine_refuses_cuda_handles():
    with pytest.raises(WeightTransferError, match="runs on the CPU"):
        HandleOpener(torch.device("cpu")).open({"GPU-0": (1, 2)})


def test_the_handles_of_one_update_check_each_file_once(shm_file, monkeypatch):
    # A per-expert push names one file thousands of times: its path is resolved and stat'ed once.
    path, data = shm_file
    resolved = []
    realpath = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p: resolved.append(p) or realpath(p))
    opener = HandleOpener(torch.device("cpu"))
    views = opener.open_all([shm_handle(path, 4 * i, 4) for i in range(16)])
    assert resolved == [path]
    assert torch.equal(torch.cat([v.view(torch.float32) for v in views]), data)
    # The next update looks again: the file may have been made anew.
    opener.open_all([shm_handle(path, 0, 4)])
    assert resolved == [path, path]
