"""Weight transfer into a served siesta, from a trainer in this process (nccl over gloo, and
ipc over shared memory): vLLM's routes and bodies, the engine's logprobs against transformers
on the pushed weights, bad input as 4xx with the server alive, a trainer that dies mid-way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from e2e.servers import HTTP_TIMEOUT_S, OFFLOAD_CONFIG, start_server, stop_server
from siesta.client import SiestaAPIError
from siesta.model.random_init import RANDOM_SHAPES
from siesta.weight_transfer import WeightSender
from siesta.weight_transfer.sender import free_port

PROMPT = [3, 17, 42, 7, 99, 5, 250, 11, 64, 8, 1, 300, 77, 21, 9, 4]
STEPS = 5
TOLERANCE = 1e-4
TRAINERS = Path(__file__).parents[1] / "weight_transfer" / "trainers.py"
KV_BYTES = str(32 << 20)
TIMEOUT_S = 5.0


def serve(backend: str):
    config = json.dumps({"backend": backend, "timeout_s": TIMEOUT_S})
    return start_server("--dev-mode", "random:tiny-llama", "--dtype", "float32", "--kv-cache-bytes", KV_BYTES,
                        "--weight-transfer-config", config, "--kv-transfer-config", OFFLOAD_CONFIG)  # fmt: skip


@pytest.fixture(scope="module", params=["nccl", "ipc"])
def server(request):
    server = serve(request.param)
    server.backend = request.param
    yield server
    stop_server(server)


def trainer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(RANDOM_SHAPES["tiny-llama"].config()).float().eval()


def served_logprobs(client) -> tuple[list[int], list[float]]:
    choice = client.completions(PROMPT, max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True)["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    return tokens, choice["logprobs"]["token_logprobs"]


def assert_serves(client, hf: torch.nn.Module) -> None:
    tokens, got = served_logprobs(client)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT + tokens])).logits[0].float(), -1)
    assert tokens[0] == int(logp[len(PROMPT) - 1].argmax())
    want = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOLERANCE


def test_pushes_over_http_make_the_server_the_trainers_model(server):
    with server.client() as client:
        assert client.get_world_size() == 1
        sender = WeightSender(client, server.backend, bucket_bytes=64 << 10)
        sender.init()
        try:
            for seed in (1, 2):
                hf = trainer(seed)
                version = sender.push(hf)
                assert client.weight_version() == version
                assert_serves(client, hf)
        finally:
            sender.close()
        metrics = client.metrics()
        assert metrics[f'siesta_weight_transfer_bytes_total{{backend="{server.backend}"}}'] > 0


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/update_weights", {}, "exactly one of model_path"),
        ("/update_weights", {"update_info": {"names": ["x"]}, "model_path": "/m"}, "exactly one of model_path"),
        ("/update_weights", {"update_info": {"names": "x", "dtype_names": [], "shapes": []}}, "'names' as a list"),
        (
            "/update_weights",
            {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]], "bogus": 1}},
            "does not take: ['bogus']",
        ),
        (
            "/update_weights",
            {
                "update_info": {
                    "names": ["model.nope.weight"],
                    "dtype_names": ["float32"],
                    "shapes": [[64]],
                    "ipc_handles": [{}],
                }
            },
            "has no place",
        ),
        ("/init_weight_transfer_engine", {}, "init_info"),
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2}},
            "",
        ),
        ("/start_weight_update", {"is_checkpoint_format": "yes"}, "is_checkpoint_format"),
        ("/finish_weight_update", {"weight_version": [1]}, "weight_version"),
    ],
)
def test_bad_bodies_are_4xx_naming_the_problem_and_the_server_lives(server, path, body, needle):
    if path == "/init_weight_transfer_engine" and "init_info" in body and server.backend == "ipc":
        needle = "the ipc backend takes an empty init_info"
    elif path == "/init_weight_transfer_engine" and "init_info" in body:
        needle = "'master_port' must be an integer >= 1"
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    assert needle in response.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    with server.client() as client:
        assert served_logprobs(client)[0]


# On the module's nccl server (a fresh one costs a start): it ends with a full push, as it found it.
@pytest.mark.parametrize("server", ["nccl"], indirect=True)
def test_a_trainer_that_dies_mid_transfer_leaves_the_server_refusing_until_a_full_push(server):
    with server.client() as client:
        version = client.weight_version()
        port = free_port()
        state = trainer(3).state_dict()
        proc = subprocess.Popen([sys.executable, str(TRAINERS), "--port", str(port), "--mode", "die-after",
                                 "--nbytes", "65536"], stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout.readline().strip() == "starting"
        client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": port,
                                            "rank_offset": 1, "world_size": 2})  # fmt: skip
        info = {"names": list(state), "dtype_names": ["float32"] * len(state),
                "shapes": [list(t.shape) for t in state.values()], "packed": True,
                "packed_buffer_size_bytes": 65536 - 1}  # fmt: skip
        client.start_weight_update()
        with pytest.raises(SiestaAPIError) as err:
            client.update_weights({"update_info": info})
        proc.wait(30)
        assert err.value.status_code == 502 and "the weight broadcast failed" in err.value.message
        assert client.weight_version() == version
        with pytest.raises(SiestaAPIError) as refused:
            client.completions(PROMPT, max_tokens=2)
        assert refused.value.status_code == 400 and "cannot generate" in refused.value.message
        assert httpx.get(server.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200
        sender = WeightSender(client, "nccl")
        sender.init()
        hf = trainer(4)
        sender.push(hf)
        sender.close()
        assert_serves(client, hf)
