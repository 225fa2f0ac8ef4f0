"""SGLang's weight routes on a served siesta, driven the way slime drives SGLang: this process is
the trainer, rank 0 of a group it joins through torch's own helper (``sglang_trainer``), posting
SGLang's bodies while it broadcasts. Oracles: transformers on the pushed weights, and for the
shared-memory path the very logprobs the same weights give when loaded from a checkpoint."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from weight_transfer.sglang_trainer import (
    Background,
    broadcast_each,
    flatten,
    flattened_bucket,
    init_group_like_sglang,
    serialize,
)

from e2e.servers import start_server, stop_server
from e2e.test_weight_transfer import PROMPT, assert_serves, served_logprobs, trainer
from siesta.client import SiestaAPIError
from siesta.weight_transfer.sender import free_port

TIMEOUT_S = 5.0  # the engine's bound on a silent trainer
CALL_S = 60.0
LOCAL_GROUP = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}
TRAINER = Path(__file__).parents[1] / "weight_transfer" / "sglang_trainer.py"


@pytest.fixture(scope="module")
def server():
    server = start_server("--dev-mode", "random:tiny-llama", "--dtype", "float32", "--kv-cache-bytes", str(32 << 20),
                          "--weight-transfer-config", json.dumps({"timeout_s": TIMEOUT_S}))  # fmt: skip
    yield server
    stop_server(server)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=CALL_S)


def later(server, path: str, body: dict) -> Background:
    """An SGLang call that answers only once the trainer did its part (joined, broadcast)."""
    return Background(lambda: post(server, path, body))


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True, body
    return body


def refused(response: httpx.Response, needle: str, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["success"] is False and needle in body["message"], body
    return body


def weight_version(server) -> str:
    return httpx.get(server.url + "/get_weight_version", timeout=CALL_S).json()["weight_version"]


def join(server, name: str):
    """slime's connect_rollout_engines: the engine's init is posted, then the trainer joins."""
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"}  # fmt: skip
    call = later(server, "/init_weights_update_group", body)
    group = init_group_like_sglang("127.0.0.1", port, 2, name, "gloo", CALL_S)
    ok(call.join(CALL_S))
    return group


def declaration(named: list[tuple[str, torch.Tensor]], name: str, **extra) -> dict:
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    return {"names": [n for n, _ in named], "dtypes": dtypes, "shapes": [list(t.shape) for _, t in named],
            "group_name": name, **extra}  # fmt: skip


def push(server, group, name: str, named: list[tuple[str, torch.Tensor]], **extra) -> httpx.Response:
    """slime's update_weights_from_distributed: metadata over HTTP while the tensors broadcast."""
    call = later(server, "/update_weights_from_distributed", declaration(named, name, **extra))
    if extra.get("load_format") == "flattened_bucket":
        broadcast_each(group, [flatten([t for _, t in named])])
    else:
        broadcast_each(group, [t for _, t in named])
    return call.join(CALL_S)


def rounded(hf: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights as sent in ``dtype``; the oracle model gets the same rounding."""
    named = [(n, t.detach().to(dtype)) for n, t in hf.state_dict().items()]
    hf.load_state_dict({n: t.float() for n, t in named})
    return named


def test_a_trainer_joined_like_slime_pushes_over_the_group_and_its_version_is_reported(server):
    name = f"slime-pp_0-{uuid.uuid4().hex[:6]}"
    group = join(server, name)
    hf = trainer(11)
    ok(push(server, group, name, rounded(hf, torch.float32), weight_version="step-1", bogus_field=1))
    assert weight_version(server) == "step-1"
    with server.client() as client:
        assert_serves(client, hf)
    # SGLang's flattened bucket: one broadcast of every tensor's bytes, bf16 cast into the fp32 weights.
    hf = trainer(12)
    ok(push(server, group, name, rounded(hf, torch.bfloat16), load_format="flattened_bucket"))
    assert weight_version(server) == "step-1+1"  # none named: the next
    with server.client() as client:
        assert_serves(client, hf)
        assert client.metrics()['siesta_weight_transfer_bytes_total{backend="nccl"}'] > 0
    ok(post(server, "/destroy_weights_update_group", {"group_name": name}))
    refused(post(server, "/update_weights_from_distributed", declaration(rounded(hf, torch.float32)[:1], name)),
            f"no weight update group {name!r}: call init_weights_update_group first")  # fmt: skip


def test_bad_updates_are_refused_with_nothing_written_and_the_group_stays_in_step(server):
    name = f"bad-{uuid.uuid4().hex[:6]}"
    group = join(server, name)
    version = weight_version(server)
    with server.client() as client:
        before = served_logprobs(client)
    # The engine refuses before writing, but still takes the broadcast: the trainer's send completes.
    refused(push(server, group, name, [("model.nope.weight", torch.ones(64))]), "model.nope.weight")
    refused(push(server, group, name, [("model.norm.weight", torch.ones(65))]), "declares shape [65]")
    refused(post(server, "/update_weights_from_distributed", declaration([("model.norm.weight", torch.ones(64))],
                                                                         "never-joined")),
            "no weight update group 'never-joined'")  # fmt: skip
    assert weight_version(server) == version
    with server.client() as client:
        assert served_logprobs(client) == before
    hf = trainer(13)
    ok(push(server, group, name, rounded(hf, torch.float32)))  # still in step after the refusals
    with server.client() as client:
        assert_serves(client, hf)
    # A layout the engine cannot read leaves it no way to take the broadcast: the group closes.
    body = declaration([("model.norm.weight", torch.ones(64))], name, load_format="delta")
    refused(post(server, "/update_weights_from_distributed", body), f"group {name!r} is closed")
    refused(post(server, "/update_weights_from_distributed", body | {"load_format": None}),
            "call init_weights_update_group first")  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/update_weights_from_disk", {"model_path": "/nope", "is_async": True}, "is_async is not supported"),
        ("/update_weights_from_disk", {"model_path": "/nope", "load_format": "pt"}, "load_format 'pt'"),
        ("/update_weights_from_disk", {"model_path": "/nope"}, "'/nope' is not a model siesta can load"),
        ("/update_weights_from_distributed", {"names": ["x"]}, "dtypes: Field required"),
        ("/init_weights_update_group", {**LOCAL_GROUP, "master_port": 1}, "'nccl' needs CUDA"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["a", "b"]}, "one entry per engine rank (1)"),
        ("/update_weight_version", {}, "new_version: Field required"),
    ],
)
def test_bodies_siesta_cannot_honour_are_refused_naming_the_field(server, path, body, needle):
    refused(post(server, path, body), needle)
    assert httpx.get(server.url + "/health", timeout=CALL_S).status_code == 200


def test_a_trainer_that_dies_mid_update_leaves_requests_refused_until_a_full_push(server):
    name = f"dies-{uuid.uuid4().hex[:6]}"
    named = rounded(trainer(14), torch.float32)
    port = free_port()
    first = named[0][1]
    proc = subprocess.Popen([sys.executable, str(TRAINER), "--port", str(port), "--group-name", name, "--mode",
                             "die-after", "--tensors", "1", "--numel", str(first.numel())],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "starting"
        ok(post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                      "rank_offset": 1, "world_size": 2, "group_name": name,
                                                      "backend": "gloo"}))  # fmt: skip
        version = weight_version(server)
        response = post(server, "/update_weights_from_distributed", declaration(named, name, weight_version="torn"))
        assert proc.wait(CALL_S) == 1
    finally:
        proc.kill()
    refused(response, "the weight broadcast failed", status=502)
    assert weight_version(server) == version
    with server.client() as client, pytest.raises(SiestaAPIError) as err:
        client.completions(PROMPT, max_tokens=2)
    assert err.value.status_code == 400 and "cannot generate" in err.value.message
    assert httpx.get(server.url + "/health", timeout=CALL_S).status_code == 200
    group = join(server, name)  # the failed broadcast closed the group: the trainer joins again
    hf = trainer(15)
    ok(push(server, group, name, rounded(hf, torch.float32), weight_version="repaired"))
    assert weight_version(server) == "repaired"
    with server.client() as client:
        assert_serves(client, hf)


@pytest.fixture
def file_system():
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


def test_shared_memory_tensors_load_bit_exact_and_a_smuggled_global_never_runs(server, file_system, tmp_path):
    hf = trainer(16)
    checkpoint = tmp_path / "ckpt"
    hf.save_pretrained(checkpoint)
    disk = ok(post(server, "/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": "disk"}))
    assert disk["num_paused_requests"] == 0 and weight_version(server) == "disk"
    with server.client() as client:
        assert_serves(client, hf)
        from_disk = served_logprobs(client)
    other = trainer(17)
    named = [(n, t.detach()) for n, t in other.state_dict().items()]
    ok(post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize(named)]}))
    assert weight_version(server) == "disk+1"
    with server.client() as client:
        assert_serves(client, other)
    named = [(n, t.detach().contiguous()) for n, t in hf.state_dict().items()]
    body = {"serialized_named_tensors": [serialize(flattened_bucket(named))], "load_format": "flattened_bucket",
            "weight_version": "shm"}  # fmt: skip
    ok(post(server, "/update_weights_from_tensor", body))
    with server.client() as client:
        assert served_logprobs(client) == from_disk  # the checkpoint's very weights, bit for bit

    marker = tmp_path / "ran"

    class Smuggler:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = base64.b64encode(pickle.dumps([("model.norm.weight", Smuggler())])).decode()
    refused(post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [evil]}),
            "it names posix.system, which is not part of a shared tensor")  # fmt: skip
    assert not marker.exists() and weight_version(server) == "shm"


def test_a_rename_is_reported_and_aborts_requests_in_flight_by_default(server):
    ok(post(server, "/update_weight_version", {"new_version": "renamed", "abort_all_requests": False}))
    assert weight_version(server) == "renamed"
    with server.client() as client:
        body = client.completions(PROMPT, max_tokens=2, temperature=0)
    assert body["weight_version"] == "renamed"
    stream = httpx.stream("POST", server.url + "/v1/completions", timeout=CALL_S,
                          json={"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True})  # fmt: skip
    with stream as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generating now
        answer = ok(post(server, "/update_weight_version", {"new_version": 7}))  # abort_all_requests: SGLang's true
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert answer["new_version"] == "7" and weight_version(server) == "7"
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
