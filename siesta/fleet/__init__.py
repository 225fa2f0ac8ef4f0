"""Many siesta replicas behind one gateway (SGLang's model gateway, ``smg``), controlled as one.

- ``gateway``: the smg process and its worker registry;
- ``rl_plane``: smg's RL control plane (fan-out, per-worker passthrough) as typed calls;
- ``client``: ``FleetClient``, every control verb as one transaction over the fleet;
- ``replicas`` / ``ray_replicas``: replicas on this host, or one Ray bundle each;
- ``fleet``: gateway + replicas + registration (``Fleet.start``); ``cli``: ``siesta fleet``.
"""

from siesta.fleet.client import FleetClient, FleetError, FleetResult, ReplicaResult

__all__ = ["FleetClient", "FleetError", "FleetResult", "ReplicaResult"]
