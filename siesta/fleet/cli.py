"""``siesta fleet``: N replicas behind the gateway, serving the gateway's URL until Ctrl-C.

    siesta fleet --replicas 4 --tensor-parallel-size 2 --port 30000 -- MODEL --kv-transfer-config ...

Everything after ``--`` is ``siesta serve``'s, for every replica (``--dev-mode`` is added: the
fleet drives the control routes). Replica i listens on ``--replica-base-port`` + i (free ports
by default) with its own GPUs; ``--ray`` places the replicas on a Ray cluster instead, one
placement-group bundle per replica. Clients send generation to the printed URL (OpenAI routes,
SGLang's /generate) and control the fleet through ``siesta.fleet.FleetClient(URL, NAME)`` or
the gateway's own ``/v1/rl/engine/...?selector=siesta.fleet=NAME``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from siesta.fleet.client import DEFAULT_FLEET
from siesta.fleet.gateway import GatewayConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="engines behind the gateway")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs per replica (one TP group)")
    p.add_argument("--name", default=DEFAULT_FLEET,
                   help="the fleet's label in the gateway (its selector: siesta.fleet=NAME)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (0.0.0.0 to serve other hosts)")
    p.add_argument("--port", type=int, default=30000, help="the gateway's port: the fleet's URL")
    p.add_argument("--replica-host", default="127.0.0.1", help="where local replicas listen")
    p.add_argument("--replica-base-port", type=int, default=None, help="replica i on this + i (default: free ports)")
    p.add_argument("--policy", default=GatewayConfig.policy,
                   help="the gateway's routing policy (smg's --policy; cache_aware sends a resumed request to "
                        "the replica whose tier holds it)")  # fmt: skip
    p.add_argument("--session-header", default=None, help="sticky sessions keyed by this request header")
    p.add_argument("--ray", action="store_true", help="place the replicas on Ray (RAY_ADDRESS, or a local cluster)")
    p.add_argument("--gateway-arg", action="append", default=[], help="one more smg flag (repeat)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `siesta serve` flags for every replica")


def run(args: argparse.Namespace) -> None:
    from siesta.fleet.fleet import Fleet, FleetSpec

    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    gateway = GatewayConfig(host=args.host, port=args.port, policy=args.policy, session_header=args.session_header,
                            extra_args=tuple(args.gateway_arg))  # fmt: skip
    spec = FleetSpec(replicas=args.replicas, tp=args.tensor_parallel_size, name=args.name,
                     serve_args=tuple(serve_args), replica_host=args.replica_host,
                     base_port=args.replica_base_port, gateway=gateway)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Fleet.start(spec, on_ray=args.ray) as fleet:
        print(json.dumps({"url": fleet.url, "fleet": spec.name,
                          "replicas": [{"index": r.spec.index, "url": r.url, "devices": r.spec.devices}
                                       for r in fleet.replicas]}), flush=True)  # fmt: skip
        print(f"siesta fleet: serving {fleet.url} ({len(fleet.replicas)} replicas); Ctrl-C stops it",
              file=sys.stderr, flush=True)  # fmt: skip
        stop.wait()
