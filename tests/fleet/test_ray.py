"""Replicas placed on Ray, as RL frameworks place their rollout workers: a local Ray cluster on
this machine, two replicas behind the real gateway (smg), one placement-group bundle each.

The cluster declares two GPUs it does not have: Ray then hands each replica's actor its own
``CUDA_VISIBLE_DEVICES``, which is what a replica must pass on to its engine (here the engine
still computes on the CPU, as torch sees no CUDA). Checked: the bundles, each replica's devices
as its process sees them, generation through the gateway reaching both replicas, a fleet
control call, and that stopping the fleet leaves no process and no placement group behind.
"""

from __future__ import annotations

import httpx
import pytest

from fleet.fleets import SERVE_ARGS, gateway_config, requires_smg, wait_gone
from siesta.bench.fleet_routing import replica_metrics
from siesta.bench.resume import metric_sum
from siesta.fleet.fleet import Fleet, FleetSpec
from siesta.fleet.ray_replicas import bundles, ray_missing

RAY_MISSING = ray_missing()
pytestmark = [requires_smg, pytest.mark.skipif(RAY_MISSING is not None, reason=RAY_MISSING or ""),
              pytest.mark.timeout(300)]  # fmt: skip

REPLICAS = 2
FAKE_GPUS = 2  # declared to Ray, so it sets CUDA_VISIBLE_DEVICES per bundle
HTTP_TIMEOUT_S = 60.0
REQUESTS = 8
PROMPT_TOKENS = "siesta_prompt_tokens_total"
# One torch thread a replica: two replicas, Ray and the test share two cores.
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=REPLICAS + 1, num_gpus=FAKE_GPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_a_bundle_per_tensor_parallel_group() -> None:
    assert bundles(2, 4, gpus=True) == [{"CPU": 1.0, "GPU": 4.0}] * 2
    assert bundles(3, 1, gpus=False) == [{"CPU": 1.0}] * 3


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}



def test_replicas_on_ray_serve_behind_the_gateway_and_leave_nothing(ray_cluster) -> None:
    from ray.util import placement_group_table

    # Round robin: the prompts share their first tokens, and cache-aware routing may send them
    # all to one replica (it did once, on a loaded 2-core machine); this checks placement, not routing.
    spec = FleetSpec(replicas=REPLICAS, name="ray", serve_args=SERVE_ARGS, gateway=gateway_config(policy="round_robin"))
    fleet = Fleet.start(spec, env=ENV, on_ray=True)
    try:
        group = fleet._stopper.group
        assert list(placement_group_table(group)["bundles"].values()) == [{"CPU": 1.0, "GPU": 1.0}] * REPLICAS
        infos = [replica.info for replica in fleet.replicas]
        pids = [info["pid"] for info in infos]
        # Each replica's engine sees its own bundle's GPU, and only that one.
        devices = [_environ(pid)["CUDA_VISIBLE_DEVICES"] for pid in pids]
        assert sorted(devices) == [str(i) for i in range(REPLICAS)]
        assert [tuple(info["devices"]) for info in infos] == [(d,) for d in devices]

        urls = [replica.url for replica in fleet.replicas]
        before = replica_metrics(urls)
        for i in range(REQUESTS):
            body = {"input_ids": [3, 17, 42 + i, 7, 99, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            response = httpx.post(f"{fleet.url}/generate", json=body, timeout=HTTP_TIMEOUT_S)
            assert response.status_code == 200, response.text
        after = replica_metrics(urls)
        served = [metric_sum(a, PROMPT_TOKENS) - metric_sum(b, PROMPT_TOKENS) for a, b in zip(after, before)]
        assert sum(served) == REQUESTS * 6 and all(s > 0 for s in served), served

        with fleet.client() as client:  # a control call fans out to the replicas on Ray
            assert client.pause(mode="keep", clear_cache=False, clear_connector_cache=False).ok
            assert client.is_paused() == {i: True for i in range(REPLICAS)}
            assert client.resume().ok
            assert client.is_paused() == {i: False for i in range(REPLICAS)}
    finally:
        fleet.stop()
    wait_gone(pids)
    assert placement_group_table(group)["state"] == "REMOVED"
