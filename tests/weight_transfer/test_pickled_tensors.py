"""SGLang's serialized tensors through the restricted unpickler: what torch's reductions make
(file_system strategy) opens bit-exact; anything else is refused by name before it runs."""

from __future__ import annotations

import base64
import io
import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing import reductions
from weight_transfer.sglang_trainer import PerRankTensor, flattened_bucket, serialize

from siesta.weight_transfer.pickled_tensors import SerializedTensors
from siesta.weight_transfer.wire import WeightTransferError

CPU = torch.device("cpu")


@pytest.fixture
def file_system():
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


@pytest.fixture
def decoder():
    d = SerializedTensors(CPU)
    yield d
    d.close()


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 5, generator=g)
    return [
        ("a.weight", torch.randn(3, 4, generator=g).bfloat16()),  # 12 bf16: 24 bytes
        ("b.weight", torch.randn(7, generator=g).half()),  # 14 bytes: the next one starts off its alignment
        ("c.weight", big[1:4, ::2]),  # a strided view into a larger storage
        ("d.weight", torch.nn.Parameter(torch.randn(2, 2, generator=g), requires_grad=False)),
    ]


def assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def test_named_tensors_shared_by_name_open_bit_exact(file_system, decoder):
    want = tensors()
    assert_same(decoder.decode(serialize(want), None), want)
    assert_same(decoder.decode(serialize(want), "direct"), want)


def test_a_flattened_bucket_opens_bit_exact_across_dtypes(file_system, decoder):
    want = [(n, t.detach().contiguous()) for n, t in tensors()]
    assert_same(decoder.decode(serialize(flattened_bucket(want)), "flattened_bucket"), want)


def test_local_serialized_tensors_open_this_ranks_entry(file_system, decoder):
    want = tensors()
    other = serialize(torch.zeros(1))
    payload = [(n, PerRankTensor([base64.b64decode(serialize(t)), base64.b64decode(other)])) for n, t in want]
    assert_same(decoder.decode(serialize(payload), None, rank=0), want)


class _Runs:
    """Pickles as a call of ``fn(*args)``: what a malicious payload would run."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _b64(obj, pickler=pickle.Pickler) -> str:
    buf = io.BytesIO()
    pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_a_forbidden_global_is_refused_by_name_without_running(decoder, tmp_path):
    marker = tmp_path / "ran"
    payload = _b64([("w", _Runs(os.system, f"touch {marker}"))])
    with pytest.raises(
        WeightTransferError, match=r"\[0\]: it names posix\.system, which is not part of a shared tensor"
    ):
        decoder.decode(payload, None)
    assert not marker.exists()
    with pytest.raises(WeightTransferError, match=r"builtins\.eval"):
        decoder.decode(_b64(_Runs(eval, "1")), None)


def test_tensor_data_pickled_whole_is_not_a_shared_tensor(decoder):
    # Plain pickling goes through torch's loader of tensor bytes: refused, not loaded.
    with pytest.raises(WeightTransferError, match="not part of a shared tensor"):
        decoder.decode(_b64([("w", torch.ones(2))]), None)


def test_the_file_descriptor_strategy_is_refused_with_the_fix(decoder):
    assert mp.get_sharing_strategy() == "file_descriptor"
    with pytest.raises(WeightTransferError, match=r"set_sharing_strategy\('file_system'\)"):
        decoder.decode(serialize([("w", torch.ones(4))]), None)


def test_a_tensor_reaching_past_its_storage_is_refused(file_system, decoder):
    storage = torch.ones(3).untyped_storage()
    typed = torch.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)
    oversized = _Runs(reductions.rebuild_tensor, torch.Tensor, typed, (0, torch.Size([1000]), (1,), False))
    with pytest.raises(WeightTransferError, match="reaches element 999 of a storage that holds 3"):
        decoder.decode(_b64([("w", oversized)], ForkingPickler), None)


@pytest.mark.parametrize(
    ("obj", "load_format", "needle"),
    [
        ({"flattened_tensor": torch.ones(2)}, "flattened_bucket", "a flattened bucket has keys"),
        ("x", None, "takes a list of"),
        ([("w", 3)], None, "not a tensor"),
        ([], "safetensors", "load_format 'safetensors' is not one siesta reads"),
    ],
)
def test_shapes_of_payload_siesta_does_not_read_are_refused(file_system, decoder, obj, load_format, needle):
    with pytest.raises(WeightTransferError, match=needle):
        decoder.decode(serialize(obj), load_format)


def test_a_bucket_entry_outside_the_bucket_is_refused(file_system, decoder):
    bucket = flattened_bucket([("w", torch.ones(4))])
    bucket["metadata"][0].end_idx = 64
    with pytest.raises(WeightTransferError, match=r"w: \[0, 64\) is not inside the bucket's 16 elements"):
        decoder.decode(serialize(bucket), "flattened_bucket")


def _nested_bomb(levels: int = 7):
    """Lists of ten references to one list, nested: a few hundred bytes of pickle (its memo keeps
    one copy a level) whose repr is 10**levels items long."""
    x: list = [0]
    for _ in range(levels):
        x = [x] * 10
    return x


def test_a_nested_repr_bomb_gives_a_short_error_at_once(file_system, decoder):
    # A 706-byte pickle like this made a 322 MB error response after 22.8 s.
    bucket = flattened_bucket([("w", torch.ones(4))])
    bucket["metadata"][0].shape = _nested_bomb()
    payload = serialize(bucket)
    assert len(payload) < 4000
    t0 = time.monotonic()
    with pytest.raises(WeightTransferError) as e:
        decoder.decode(payload, "flattened_bucket")
    assert time.monotonic() - t0 < 1.0
    assert "shape must be a sequence of integers" in str(e.value) and len(str(e.value)) < 600


# -- CUDA: the trainer's tensors from another process (GPU only; bench/gpu.sh runs these) --------


def _cuda_sharer(conn, flat: bool) -> None:
    """A trainer: its CUDA tensors, serialized as SGLang's sender does, stay alive until told."""
    import torch as t

    from weight_transfer.sglang_trainer import flattened_bucket as bucket
    from weight_transfer.sglang_trainer import serialize as dump

    named = [(n, x.detach().contiguous().cuda()) for n, x in tensors()]
    t.cuda.synchronize()
    conn.send(dump(bucket(named) if flat else named))
    conn.recv()  # the engine has copied them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by bench/gpu.sh)")
@pytest.mark.parametrize("flat", [False, True])
def test_cuda_tensors_of_another_process_open_bit_exact(flat):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cuda_sharer, args=(child, flat))
    proc.start()
    decoder = SerializedTensors(torch.device("cuda"))
    try:
        got = decoder.decode(parent.recv(), "flattened_bucket" if flat else None)
        copies = [(n, x.clone()) for n, x in got]
        torch.cuda.synchronize()
    finally:
        parent.send("done")
        proc.join(60)
        decoder.close()
    assert all(x.is_cuda for _, x in copies)
    assert_same([(n, x.cpu()) for n, x in copies], [(n, x.detach().contiguous()) for n, x in tensors()])
