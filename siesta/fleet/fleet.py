"""A fleet: N replicas registered with one gateway, whose URL is the fleet's.

``Fleet.start`` runs the gateway, starts the replicas side by side (here, or on Ray through
``siesta.fleet.ray_replicas``), and registers each with the gateway once it is healthy, labelled
with the fleet's name and its index. ``siesta fleet`` is this, until Ctrl-C.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Self

from siesta.fleet.client import DEFAULT_FLEET, FleetClient
from siesta.fleet.gateway import Gateway, GatewayConfig, free_port
from siesta.fleet.replicas import ReplicaSpec, device_groups, launch_local, visible_devices


class Replica(Protocol):
    """What the fleet needs of a replica, wherever it runs."""

    spec: ReplicaSpec

    @property
    def url(self) -> str: ...
    def stop(self) -> None: ...
    def kill(self) -> None: ...


@dataclass(frozen=True)
class FleetSpec:
    replicas: int = 2
    tp: int = 1  # GPUs (engine ranks) per replica: one tensor-parallel group each
    name: str = DEFAULT_FLEET
    serve_args: tuple[str, ...] = ()  # `siesta serve` flags for every replica (model, KV, tier...)
    replica_host: str = "127.0.0.1"
    base_port: int | None = None  # replica i on base_port + i; None: free ports
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def replica_specs(self, devices: list[str] | None = None) -> list[ReplicaSpec]:
        groups = device_groups(self.replicas, self.tp, visible_devices() if devices is None else devices)
        ports = [self.base_port + i if self.base_port else free_port(self.replica_host) for i in range(self.replicas)]
        return [ReplicaSpec(i, self.replica_host, ports[i], groups[i], self.tp) for i in range(self.replicas)]


@dataclass
class Fleet:
    spec: FleetSpec
    gateway: Gateway
    replicas: list[Replica]
    worker_ids: dict[int, str] = field(default_factory=dict)
    _stopper: object = None  # what else stop() must release (Ray's placement group)

    @property
    def url(self) -> str:
        return self.gateway.url

    @classmethod
    def start(cls, spec: FleetSpec, log_dir: Path | None = None, env: dict[str, str] | None = None,
              on_ray: bool = False) -> Fleet:  # fmt: skip
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="siesta-fleet-"))
        gateway = Gateway.start(spec.gateway, log_dir)
        fleet = cls(spec, gateway, [])
        try:
            if on_ray:
                from siesta.fleet.ray_replicas import launch_on_ray

                fleet.replicas, fleet._stopper = launch_on_ray(spec, env)
            else:
                fleet.replicas = list(launch_local(spec.replica_specs(), spec.serve_args, log_dir, env))
            for replica in fleet.replicas:
                fleet.register(replica)
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def register(self, replica: Replica) -> str:
        worker_id = self.gateway.register(replica.url, self.spec.name, replica.spec.index, replica.spec.tp)
        self.worker_ids[replica.spec.index] = worker_id
        return worker_id

    def client(self) -> FleetClient:
        return FleetClient(self.url, self.spec.name, gateway=self.gateway)

    def replica(self, index: int) -> Replica:
        return next(r for r in self.replicas if r.spec.index == index)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()
        if self._stopper is not None:
            self._stopper.close()  # type: ignore[attr-defined]
        self.gateway.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
