"""CUDA IPC pushes from a trainer in another process into an in-process engine (GPU only).

A spawned child is the trainer: it holds CUDA tensors and runs ``WeightSender`` against
an engine proxy whose every call comes back over a pipe to this process, which runs it on
the ``LLM``. So the handles are torch's real ones, pickled and opened across processes, and
they pass the restricted unpickler. Both sides generate the same random tensors from a seed,
so the engine's parameters are checked bit for bit against what the trainer sent.
``bash bench/gpu.sh`` runs these on the H200.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by bench/gpu.sh)")

SHAPE = "tiny-llama"
MODEL = f"random:{SHAPE}"
KV_CACHE_BYTES = 64 << 20
BUCKET_BYTES = 64 << 10  # several buckets of the tiny model's 0.4 MB
ANSWER_TIMEOUT_S = 120.0
LATE_WRITE_CYCLES = 1_000_000_000  # ~0.5 s of torch.cuda._sleep on an H200: far longer than the handle's trip


def _tensors(seed: int, dtype: torch.dtype, device: str = "cuda") -> dict[str, torch.Tensor]:
    from siesta.model.random_init import RandomCheckpoint

    return dict(RandomCheckpoint(SHAPE, seed).iter_weights(dtype, device))


# -- the trainer child -----------------------------------------------------------------------


class _PipeEngine:
    """The engine as the trainer sees it: each call runs on the parent's LLM."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _call(self, name: str, *args: Any) -> Any:
        self.conn.send(("call", name, args))
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> Any:
        return self._call("init_weight_transfer_engine", request)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> Any:
        return self._call("start_weight_update", is_checkpoint_format)

    def update_weights(self, weights: Any, weight_version: str | None = None) -> Any:
        return self._call("update_weights", weights, weight_version)

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        return self._call("finish_weight_update", weight_version)

    def get_world_size(self) -> int:
        return self._call("get_world_size")


def _trainer_main(conn: Any) -> None:
    """Holds each (seed, dtype)'s tensors until told to exit; pushes them or hands out handles."""
    from torch.multiprocessing.reductions import reduce_tensor

    from siesta.weight_transfer import WeightSender

    torch.cuda.set_device(0)
    held: dict[Any, dict[str, torch.Tensor]] = {}
    senders = []  # a packed sender's bucket must outlive the engine's use of it
    while True:
        cmd, spec = conn.recv()
        if cmd == "exit":
            conn.send(("bye", None))
            return
        try:
            if cmd == "write_and_share":  # a trainer that shares right after its last write, unsynchronized
                if "late" not in held:
                    held["late"] = {spec["name"]: torch.zeros(spec["shape"], dtype=torch.bfloat16, device="cuda")}
                tensor = held["late"][spec["name"]]
                torch.cuda._sleep(spec["sleep_cycles"])  # the write is still queued when the handle leaves
                tensor.fill_(spec["value"])
                uuid = str(torch.cuda.get_device_properties(0).uuid)
                conn.send(("done", {"uuid": uuid, "args": reduce_tensor(tensor)[1]}))
                continue
            key = (spec["seed"], spec["dtype"])
            if key not in held:
                held[key] = _tensors(spec["seed"], getattr(torch, spec["dtype"]))
            tensors = held[key]
            if cmd == "push":
                sender = WeightSender(_PipeEngine(conn), "ipc", packed=spec.get("packed", False),
                                      bucket_bytes=spec.get("bucket_bytes", BUCKET_BYTES))  # fmt: skip
                senders.append(sender)
                sender.init()
                conn.send(("done", sender.push(tensors)))
            elif cmd == "handles":
                torch.cuda.synchronize()
                conn.send(("done", {
                    "uuid": str(torch.cuda.get_device_properties(0).uuid),
                    "names": list(tensors),
                    "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                    "shapes": [list(t.shape) for t in tensors.values()],
                    "args": [reduce_tensor(t)[1] for t in tensors.values()],
                }))  # fmt: skip
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # noqa: BLE001 - reported to the parent
            conn.send(("failed", f"{type(e).__name__}: {e}"))


class Trainer:
    def __init__(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_trainer_main, args=(child,), daemon=True)
        self.process.start()
        self.calls: list[tuple[str, tuple]] = []

    def run(self, llm, cmd: str, **spec: Any) -> Any:
        """One command; the engine calls it makes are run on ``llm`` meanwhile."""
        self.calls = []
        self.conn.send((cmd, spec))
        while True:
            if not self.conn.poll(ANSWER_TIMEOUT_S):
                raise AssertionError(f"the trainer did not answer {cmd} within {ANSWER_TIMEOUT_S:.0f}s")
            msg = self.conn.recv()
            if msg[0] == "call":
                _, name, args = msg
                self.calls.append((name, args))
                try:
                    self.conn.send(("ok", getattr(llm, name)(*args)))
                except Exception as e:  # noqa: BLE001 - the trainer raises it
                    self.conn.send(("error", f"{type(e).__name__}: {e}"))
            elif msg[0] == "done":
                return msg[1]
            else:
                raise AssertionError(f"the trainer failed: {msg[1]}")

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit", None))
            self.conn.poll(ANSWER_TIMEOUT_S)
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def trainer():
    t = Trainer()
    yield t
    t.close()


@pytest.fixture(scope="module")
def llm(trainer):  # after the trainer, so it is gone before the trainer's memory
    from siesta import LLM

    engine = LLM(model=MODEL, device="cuda", dtype="bfloat16", weight_transfer_config={"backend": "ipc"},
                 kv_cache_bytes=KV_CACHE_BYTES, max_model_len=512)  # fmt: skip
    yield engine
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _mismatches(llm, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose destination in the engine (fused rows included) is not ``expected``'s bf16 bits."""
    model = llm.engine.runner.model
    bad = []
    for name, want in expected.items():
        target = model.weight_target(name)
        if target is None:
            continue
        if not torch.equal(target.view, want.to(target.view.dtype)):
            bad.append(name)
    return bad


def _generates(llm) -> None:
    from siesta import SamplingParams

    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


# -- tests -----------------------------------------------------------------------------------


def test_an_unpacked_bf16_push_lands_bit_exact(llm, trainer):
    expected = _tensors(7, torch.bfloat16)
    assert _mismatches(llm, expected), "the engine already holds seed 7's weights: the check would prove nothing"
    version = trainer.run(llm, "push", seed=7, dtype="bfloat16")
    assert _mismatches(llm, expected) == []
    assert llm.weight_version == version
    updates = [args for name, args in trainer.calls if name == "update_weights"]
    # One call, its handles pickled: they went through the restricted unpickler.
    assert len(updates) == 1 and "ipc_handles_pickled" in updates[0][0]["update_info"]
    _generates(llm)


def test_a_packed_push_lands_bit_exact(llm, trainer):
    expected = _tensors(8, torch.bfloat16)
    trainer.run(llm, "push", seed=8, dtype="bfloat16", packed=True, bucket_bytes=BUCKET_BYTES)
    buckets = [args for name, args in trainer.calls if name == "update_weights"]
    assert len(buckets) > 1, "the bucket size should cut the tiny model into several buckets"
    assert all(b[0]["update_info"]["packed"] for b in buckets)
    assert _mismatches(llm, expected) == []
    _generates(llm)


def test_an_fp32_push_lands_as_the_bf16_cast(llm, trainer):
    masters = _tensors(9, torch.float32)
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in masters.values()), "no rounding to test"
    trainer.run(llm, "push", seed=9, dtype="float32")
    assert _mismatches(llm, masters) == []  # compared with each master's bf16 cast


def test_a_second_push_of_the_same_tensors_reuses_the_opened_handles(llm, trainer, monkeypatch):
    opened: list[int] = []
    plain = torch.UntypedStorage._new_shared_cuda  # what rebuild_cuda_tensor calls on a cache miss

    def counting(*args: Any, **kwargs: Any):
        opened.append(1)
        return plain(*args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(counting))
    expected = _tensors(10, torch.bfloat16)
    trainer.run(llm, "push", seed=10, dtype="bfloat16")
    first = len(opened)
    assert first > 0, "the first push opened no IPC handle: the test does not see the opens"
    assert _mismatches(llm, expected) == []
    opened.clear()
    trainer.run(llm, "push", seed=10, dtype="bfloat16")  # the same tensors of the same trainer
    assert _mismatches(llm, expected) == []
    assert len(opened) == 0, (
        f"the second push opened {len(opened)} IPC handles again ({first} the first time): the engine did not keep "
        "the storages it opened (torch's shared_cache holds only weak references; once they are gone the mapping "
        "is closed with cudaIpcCloseMemHandle), so every push pays the first open again"
    )


def test_raw_ipc_handles_in_both_of_vllms_forms_land(llm, trainer):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    expected = _tensors(11, torch.bfloat16)
    h = trainer.run(llm, "handles", seed=11, dtype="bfloat16")
    # vLLM sends {uuid: args}; torch's reduce_tensor gives (rebuild_cuda_tensor, args): take both.
    uuid = h["uuid"]
    handles = [{uuid: args} if i % 2 else {uuid: (rebuild_cuda_tensor, args)} for i, args in enumerate(h["args"])]
    info = {"names": h["names"], "dtype_names": h["dtype_names"], "shapes": h["shapes"], "ipc_handles": handles}
    llm.start_weight_update()
    llm.update_weights({"update_info": info})
    llm.finish_weight_update()
    assert _mismatches(llm, expected) == []
    _generates(llm)


def test_a_handle_for_another_gpu_is_refused_and_writes_nothing(llm, trainer):
    from siesta.weight_transfer import WeightTransferError

    before = {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}
    version = llm.weight_version
    h = trainer.run(llm, "handles", seed=12, dtype="bfloat16")
    info = {"names": h["names"], "dtype_names": h["dtype_names"], "shapes": h["shapes"],
            "ipc_handles": [{"GPU-00000000-not-this-one": args} for args in h["args"]]}  # fmt: skip
    with pytest.raises(WeightTransferError, match="no IPC handle for this engine's GPU"):
        llm.update_weights({"update_info": info})
    llm.finish_weight_update()  # the refused update opened the update; nothing was written
    assert llm.weight_version == version
    for n, p in llm.engine.runner.model.named_parameters():
        assert torch.equal(p, before[n]), n
    _generates(llm)


def test_a_trainer_that_shares_without_synchronizing_is_read_after_its_writes(llm, trainer):
    """torch's IPC handle carries an event recorded after the trainer's queued writes, and
    torch's consumer waits on it when it opens a storage. vLLM's trainer sends right after
    ``reduce_tensor``, without synchronizing; so the engine must order its copy after that
    event at every push, also when it reuses a mapping it opened before (torch's own cache
    hit skips the event)."""
    name = "model.norm.weight"
    shape = list(llm.engine.runner.model.weight_target(name).view.shape)
    for value in (1.5, 2.5, 3.5):  # the first opens the handle, the later ones may reuse it
        h = trainer.run(llm, "write_and_share", name=name, shape=shape, value=value, sleep_cycles=LATE_WRITE_CYCLES)
        info = {"names": [name], "dtype_names": ["bfloat16"], "shapes": [shape],
                "ipc_handles": [{h["uuid"]: h["args"]}]}  # fmt: skip
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
        llm.finish_weight_update()
        got = llm.engine.runner.model.weight_target(name).view
        assert torch.all(got == value), (
            f"push of {value}: the engine copied {got.flatten()[:4].tolist()} before the trainer's queued write "
            "landed (a reused mapping must still wait on the handle's event)"
        )
