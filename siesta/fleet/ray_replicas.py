"""Replicas on Ray, where RL frameworks place their rollout workers (verl, OpenRLHF, slime's
placement): one placement-group bundle per replica, that is per tensor-parallel group.

A bundle is ``{"GPU": tp, "CPU": 1}`` on a cluster with GPUs (``{"CPU": 1}`` without), so a
replica's GPUs are on one node, the node Ray picked. In the bundle an actor starts ``siesta
serve`` as a child, with the ``CUDA_VISIBLE_DEVICES`` Ray set for the actor (its bundle's GPUs,
which the engine sees as cuda:0..tp-1), on a free port of its node, bound to the node's address;
its URL is what the gateway registers. The replica dies with its actor (and the actor with the
driver, Ray's default), so a fleet leaves nothing behind on any node.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from siesta.fleet.replicas import LocalReplica, ReplicaSpec

RAY_MISSING = "ray is not installed (pip install ray): replicas on Ray need it"
START_TIMEOUT_S = 600.0


def ray_missing() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return RAY_MISSING
    return None


class _ReplicaActor:
    """Runs one replica's process on the node of its bundle (made a Ray actor in ``_actor_class``)."""

    def __init__(self) -> None:
        self.replica: LocalReplica | None = None

    def start(self, index: int, tp: int, serve_args: list[str], env: dict[str, str] | None) -> dict[str, Any]:
        import ray

        from siesta.fleet.gateway import free_port

        host = ray.util.get_node_ip_address()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # Ray's: this bundle's GPUs
        devices = tuple(d for d in visible.split(",") if d) if visible and ray.get_gpu_ids() else None
        spec = ReplicaSpec(index, host, free_port(host), devices, tp)
        log_dir = Path(tempfile.mkdtemp(prefix=f"siesta-ray-replica-{index}-"))
        self.replica = LocalReplica.launch(spec, serve_args, log_dir, os.environ | (env or {}))
        self.replica.wait_healthy()
        return {"url": spec.url, "host": host, "port": spec.port, "devices": devices,
                "pid": self.replica.process.pid, "log": str(self.replica.log_path)}  # fmt: skip

    def stop(self) -> None:
        if self.replica is not None:
            self.replica.stop()

    def kill(self) -> None:
        if self.replica is not None:
            self.replica.kill()


@dataclass
class RayReplica:
    spec: ReplicaSpec
    actor: Any
    info: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        finally:
            ray.kill(self.actor)

    def kill(self) -> None:
        import ray

        ray.get(self.actor.kill.remote(), timeout=60)


class PlacementGroup:
    """The fleet's placement group, released when the fleet stops."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def bundles(replicas: int, tp: int, gpus: bool) -> list[dict[str, float]]:
    """One bundle per tensor-parallel group: its GPUs, and a CPU for the API server."""
    return [{"CPU": 1.0, "GPU": float(tp)} if gpus else {"CPU": 1.0} for _ in range(replicas)]


def launch_on_ray(
    spec: Any, env: dict[str, str] | None = None, strategy: str = "PACK"
) -> tuple[list[RayReplica], PlacementGroup]:
    """Start ``spec.replicas`` replicas on the Ray cluster this process is connected to (or a
    local one), one bundle each; returns them once all are healthy, and their placement group."""
    missing = ray_missing()
    if missing:
        raise RuntimeError(missing)
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    group = placement_group(bundles(spec.replicas, spec.tp, gpus), strategy=strategy)
    ray.get(group.ready(), timeout=START_TIMEOUT_S)
    actor_class = _actor_class()
    actors = [
        actor_class.options(
            num_cpus=1,
            num_gpus=spec.tp if gpus else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote()
        for i in range(spec.replicas)
    ]
    try:
        infos = ray.get([a.start.remote(i, spec.tp, list(spec.serve_args), env) for i, a in enumerate(actors)],
                        timeout=START_TIMEOUT_S)  # fmt: skip
    except BaseException:
        for a in actors:
            ray.kill(a)
        PlacementGroup(group).close()
        raise
    replicas = [
        RayReplica(ReplicaSpec(i, info["host"], info["port"], info["devices"], spec.tp), actor, info)
        for i, (actor, info) in enumerate(zip(actors, infos))
    ]
    return replicas, PlacementGroup(group)


def _actor_class() -> Any:
    import ray

    return ray.remote(_ReplicaActor)
