"""SGLang's weight routes without an engine process: their answers' shape and status for every
kind of failure, the options they pass on, and that they exist in dev mode only."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from siesta.control import EngineStateError, OneCallResult
from siesta.entrypoints.server.app import build_app
from siesta.entrypoints.server.state import ServerConfig
from siesta.ipc.protocol import EngineInfo
from siesta.ipc.remote_errors import EngineDeadError
from siesta.metrics import MetricsRegistry
from siesta.weight_transfer.updater import UpdateFailed

ROUTES = ["/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
          "/update_weights_from_tensor", "/update_weights_from_disk", "/update_weight_version"]  # fmt: skip
DISK = {"model_path": "/ckpt"}


class FakeCore:
    """Records what the routes ask of the engine; ``fail`` is raised by the next call."""

    def __init__(self) -> None:
        self.info = EngineInfo(model_name="fake", max_model_len=64, vocab_size=100, block_size=16, num_blocks=4)
        self.metrics = MetricsRegistry()
        self.is_alive, self.dead_reason = True, None
        self.calls: list[tuple] = []
        self.fail: BaseException | None = None

    def _answer(self, *call):
        self.calls.append(call)
        if self.fail is not None:
            raise self.fail
        return OneCallResult("v7", kept_requests=2, missing_tensors=0)

    async def update_weights_from_disk(self, model_path, options):
        return self._answer("disk", model_path, options)

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format, options):
        return self._answer("distributed", names, group_name, load_format, options)

    async def update_weight_version(self, new_version, abort_all_requests=True):
        self._answer("rename", new_version, abort_all_requests)
        return new_version

    async def shutdown(self):
        pass


def client_for(dev_mode: bool):
    core = FakeCore()

    async def start():
        return core, None

    return TestClient(build_app(ServerConfig(dev_mode=dev_mode), start)), core


@pytest.fixture
def fake():
    client, core = client_for(True)
    with client:
        yield client, core


def test_the_routes_exist_only_in_dev_mode():
    client, _ = client_for(False)
    with client:
        assert all(client.post(path, json={}).status_code == 404 for path in ROUTES)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (UpdateFailed("the weight broadcast failed"), 502),  # the trainer went away mid-update
        (EngineStateError("a weight update is open"), 400),  # SGLang answers every failure with a 400
        (ValueError("model.nope.weight has no place"), 400),
        (EngineDeadError("the engine core exited"), 503),
    ],
)
def test_a_failure_is_success_false_with_its_status(fake, error, status):
    client, core = fake
    core.fail = error
    response = client.post("/update_weights_from_disk", json=DISK)
    assert response.status_code == status
    assert response.json() == {"success": False, "message": str(error), "num_paused_requests": 0}


def test_a_bad_body_is_answered_in_sglangs_shape(fake):
    client, core = fake
    response = client.post("/update_weights_from_distributed", content=b"{not json", headers={"content-type": "x"})
    assert response.status_code == 400 and response.json()["success"] is False
    assert "not valid JSON" in response.json()["message"]
    body = client.post("/update_weights_from_disk", json=DISK | {"keep_pause": True}).json()
    assert body["success"] is False and "keep_pause is not supported by siesta" in body["message"]
    assert core.calls == []


def test_the_options_reach_the_engine_and_unknown_fields_are_ignored_with_a_warning(fake, caplog):
    client, core = fake
    with caplog.at_level(logging.WARNING):
        body = client.post("/update_weights_from_disk", json=DISK | {"weight_version": 3, "torch_empty_cache": True,
                                                                     "rid": "r1", "not_sglangs": 1}).json()  # fmt: skip
    assert body == {"success": True, "message": "weights updated; weight version v7", "num_paused_requests": 2}
    _, path, options = core.calls[-1]
    assert (path, options.weight_version, options.empty_cache, options.flush_cache) == ("/ckpt", "3", True, True)
    assert "not_sglangs" in caplog.text and "'rid'" not in caplog.text
    shapes = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]]}
    assert client.post("/update_weights_from_distributed", json=shapes).json()["success"] is True
    assert core.calls[-1][2:4] == ("weight_update_group", None)  # SGLang's defaults


def test_a_rename_answers_the_new_version_and_aborts_by_default(fake):
    client, core = fake
    body = client.post("/update_weight_version", json={"new_version": "step-3"}).json()
    assert body["success"] is True and body["new_version"] == "step-3"
    assert core.calls[-1] == ("rename", "step-3", True)
