"""Control of a whole fleet as one transaction, through the gateway's RL control plane.

Every verb goes to every replica of the fleet in one fan-out (smg's ``/v1/rl/engine/...``), and
its answer is success only if every replica succeeded; otherwise a ``FleetError`` carries each
replica's outcome and what the client did about the others:

- ``pause`` / ``sleep`` that fail on some replicas are undone on the rest (``resume`` /
  ``wake_up``): the fleet is again as it was, less the replicas that failed.
- A weight update is one transaction: the fleet is paused (``mode="keep"``: requests in
  flight wait, new ones queue) before anything is written, every replica writes and publishes
  the same version name, the versions are read back, the gateway's registry is relabelled, and
  only then does the fleet resume. If any replica fails, nothing resumes: the fleet stays paused
  and says so, and the replicas that failed are *suspect* (their weights may be torn, or old
  under the new name's neighbours). ``resume`` refuses while a suspect is registered or the
  versions differ, so no replica ever serves a version the others do not. A suspect is cleared
  by a later update that succeeds on it, or by ``drop`` (it leaves the gateway).

Replicas in a weight-transfer group each join at their own rank offset (slime's rule: replica
i at 1 + the ranks of the replicas before it), which a fan-out cannot say (one body for all):
``init_weight_transfer_engine`` calls each replica through the gateway's per-worker passthrough.

Its verbs are ``siesta.control.EngineControl``'s, with its names and defaults, each fanned out on
the verb's route (``HTTP_ROUTES``; ``tests/test_control_surface.py`` holds them to it): actions
answer a ``FleetResult``, queries one value a replica.

The client speaks vLLM's weight-transfer calls, so ``siesta.weight_transfer.WeightSender``
pushes into a fleet as into one engine (``WeightSender(FleetClient(url), "nccl")``; over gloo on
the CPU): one broadcast from the trainer reaches every replica's ranks. ``push`` runs a
sender's update as the transaction above and, when the trainer's side breaks off (a replica
died mid-broadcast), waits for the replicas' own answers so that its error says which got what.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

from siesta.control import HTTP_ROUTES, init_info_of
from siesta.fleet.gateway import WEIGHT_VERSION_LABEL, Gateway
from siesta.fleet.rl_plane import CALL_TIMEOUT_S, Outcome, Replica, RlPlane

DEFAULT_FLEET = "default"
# The pause a weight update runs under: requests in flight keep their KV and resume on the new
# weights (their outputs' weight_versions spans say which tokens which weights sampled); the
# caches are left to the update, which evicts other versions' KV itself.
UPDATE_PAUSE = {"mode": "keep", "clear_cache": False, "clear_connector_cache": False}


@dataclass(frozen=True)
class ReplicaResult:
    index: int
    url: str
    ok: bool
    detail: str
    body: Any = None


@dataclass(frozen=True)
class FleetResult:
    """One verb's answer from every replica, and what the client did after a failure."""

    verb: str
    replicas: tuple[ReplicaResult, ...]
    note: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.replicas) and all(r.ok for r in self.replicas)

    @property
    def failed(self) -> list[ReplicaResult]:
        return [r for r in self.replicas if not r.ok]

    @property
    def succeeded(self) -> list[ReplicaResult]:
        return [r for r in self.replicas if r.ok]

    def __str__(self) -> str:
        head = f"{self.verb}: {len(self.succeeded)} of {len(self.replicas)} replicas succeeded"
        lines = [f"replica {r.index} ({r.url}): {r.detail}" for r in self.failed]
        return "; ".join([head, *lines] + ([self.note] if self.note else []))


class FleetError(RuntimeError):
    def __init__(self, result: FleetResult) -> None:
        super().__init__(str(result))
        self.result = result


@dataclass
class _Update:
    """The weight update in progress: the fleet was paused for it and stays so until it commits."""

    members: tuple[Replica, ...]
    opened_by: str  # "start" (vLLM's calls: finish commits), "block" (updating()), "push"
    failed: dict[int, str] = field(default_factory=dict)  # replica index -> why
    inflight: int = 0
    settled: threading.Condition = field(default_factory=threading.Condition)


class FleetClient:
    def __init__(self, gateway_url: str, fleet: str = DEFAULT_FLEET, timeout_s: float = CALL_TIMEOUT_S,
                 gateway: Gateway | None = None) -> None:  # fmt: skip
        self.plane = RlPlane(gateway_url, timeout_s)
        self.fleet = fleet
        self.gateway = gateway or Gateway.attach(gateway_url)
        self.suspects: dict[int, str] = {}  # replica index -> why it may serve what the others do not
        self._update: _Update | None = None
        self._ranks: tuple[Replica, ...] | None = None  # the members get_world_size counted
        self._members: dict[str, Replica] = {}  # worker id -> replica (indices of fan-out answers)

    # -- the replicas --------------------------------------------------------------------

    def replicas(self) -> list[Replica]:
        return self.plane.replicas(self.fleet)

    def drop(self, index: int) -> None:
        """Take a replica out of the gateway (no traffic, no control): the way out for one that
        died or failed an update. Its process is the launcher's to stop."""
        replica = next((r for r in self.replicas() if r.index == index), None)
        if replica is not None:
            self.gateway.deregister(replica.worker_id)
        self.suspects.pop(index, None)
        self._ranks = None  # the group's rank offsets are the remaining replicas' now

    # -- one verb to every replica -------------------------------------------------------

    def _fanout(self, verb: str, method: str, path: str, params: dict[str, Any] | None = None,
                body: Any = None, only: Sequence[int] | None = None) -> FleetResult:  # fmt: skip
        outcomes = self.plane.fanout(self.fleet, method, path, params, body, only)
        if any(o.worker_id not in self._members for o in outcomes):  # registered since: read the registry again
            self._members = {r.worker_id: r for r in self.replicas()}
        return FleetResult(verb, tuple(sorted((_result(o, self._members) for o in outcomes), key=lambda r: r.index)))

    def _verb(self, verb: str, params: dict[str, Any] | None = None, body: Any = None,
              only: Sequence[int] | None = None) -> FleetResult:  # fmt: skip
        """One control verb to every replica (or those in ``only``), on its route."""
        method, path = HTTP_ROUTES[verb]
        return self._fanout(verb, method, path, params, body, only)

    def _all(self, result: FleetResult, undo: Callable[[list[int]], FleetResult] | None = None,
             undo_name: str = "") -> FleetResult:  # fmt: skip
        """``result`` if every replica succeeded; else undo it on those that did, and raise."""
        if result.ok:
            return result
        note = ""
        done = [r.index for r in result.succeeded]
        if undo is not None and done:
            undone = undo(done)
            note = (f"undone: {undo_name} on replicas {_indices(done)}" if undone.ok
                    else f"and {undo_name} failed too ({undone})")  # fmt: skip
        raise FleetError(FleetResult(result.verb, result.replicas, note))

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> FleetResult:
        params = {"mode": mode, "clear_cache": clear_cache, "clear_connector_cache": clear_connector_cache}
        return self._all(self._verb("pause", params), self._resume_only, "resume")

    def resume(self) -> FleetResult:
        """Resume every replica, once they serve one version and none is suspect."""
        if self.suspects:
            raise FleetError(FleetResult("resume", (), "refused: the fleet stays paused while replicas "
                                         f"{_indices(self.suspects)} may serve other weights "
                                         f"({_why(self.suspects)}): update them again or drop them"))  # fmt: skip
        versions = self.weight_versions()
        if len(set(versions.values())) > 1:
            raise FleetError(FleetResult("resume", (), f"refused: the replicas serve different versions {versions}"))
        return self._all(self._verb("resume"))

    def _resume_only(self, indices: list[int]) -> FleetResult:
        return self._verb("resume", only=indices)

    def sleep(
        self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags: list[str] | None = None
    ) -> FleetResult:
        """``clear_connector_cache=False`` keeps every replica's tier (``mode="keep"`` resumes the
        requests in flight after ``wake_up``, each on its own replica, loading from its tier)."""
        params: dict[str, Any] = {"level": level, "mode": mode, "clear_connector_cache": clear_connector_cache}
        if tags is not None:
            params["tags"] = tags
        return self._all(self._verb("sleep", params), self._wake_only, "wake_up")

    def _wake_only(self, indices: list[int]) -> FleetResult:
        return self._verb("wake_up", only=indices)

    def wake_up(self, tags: list[str] | None = None) -> FleetResult:
        return self._all(self._verb("wake_up", None if tags is None else {"tags": tags}))

    def is_paused(self) -> dict[int, bool]:
        result = self._all(self._verb("is_paused"))
        return {r.index: bool(r.body["is_paused"]) for r in result.replicas}

    def is_sleeping(self) -> dict[int, bool]:
        result = self._all(self._verb("is_sleeping"))
        return {r.index: bool(r.body["is_sleeping"]) for r in result.replicas}

    def weight_versions(self) -> dict[int, str]:
        result = self._all(self._verb("get_weight_version"))
        return {r.index: str(r.body["weight_version"]) for r in result.replicas}

    def get_weight_version(self) -> str:
        """The version every replica serves (FleetError when they differ)."""
        versions = self.weight_versions()
        if len(set(versions.values())) != 1:
            raise FleetError(FleetResult("weight_version", (), f"the replicas serve different versions {versions}"))
        return next(iter(versions.values()))

    def weight_version(self) -> str:
        """``get_weight_version`` (the name this client had first)."""
        return self.get_weight_version()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> FleetResult:
        """``reset_external`` is the route's name (vLLM's) for the engine's ``reset_connector``: the KV tiers."""
        params = {"reset_running_requests": reset_running_requests, "reset_external": reset_external}
        return self._all(self._verb("reset_prefix_cache", params))

    def abort_requests(self, request_ids: list[str]) -> FleetResult:
        """Abort requests by id on every replica (each ends those it serves; the others have none)."""
        return self._all(self._verb("abort_requests", body={"request_ids": list(request_ids)}))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> FleetResult:
        """Rename the weights on every replica and relabel the gateway. A rename that fails on
        some replicas leaves their versions differing, so ``resume`` refuses until it is redone."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        result = self._all(self._verb("update_weight_version", body=body))
        self._relabel(str(new_version))
        return result

    # -- weight updates: one transaction -------------------------------------------------

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Pause the fleet, run the body's updates, then (all succeeded) check that every replica
        serves one version, relabel the gateway and resume. On a failure the fleet stays paused."""
        self._begin("block")
        try:
            yield
        except BaseException as e:
            raise self._abandon(e) from e
        self._commit()

    def update_weights(self, weights: str | dict[str, Any], weight_version: str | None = None) -> str:
        """A model path (read by every replica: a checkpoint on a filesystem they share, or
        ``random:<shape>``), or an update_info of the weight-transfer backend. Returns the version."""
        if isinstance(weights, dict):
            body = weights if set(weights) == {"update_info"} else {"update_info": weights}
            if self._update is None:
                self._begin("start")  # vLLM lets update_weights open the update: so does the fleet
            self._record(lambda: self._verb("update_weights", body=body))
            return ""  # published by finish_weight_update
        if self._update is not None:
            version = weight_version or self._next_version()
            self._record(lambda: self._verb("update_weights", body={"model_path": weights, "weight_version": version}))
            return version
        with self.updating():
            version = weight_version or self._next_version()
            self._record(lambda: self._verb("update_weights", body={"model_path": weights, "weight_version": version}))
        return version

    def get_world_size(self) -> int:
        """Engine ranks of the whole fleet (each replica's tensor-parallel size, summed)."""
        members = tuple(self.replicas())
        result = self._all(self._verb("get_world_size"))
        sizes = {r.index: int(r.body["world_size"]) for r in result.replicas}
        self._ranks = tuple(_with_ranks(m, sizes[m.index]) for m in members)
        return sum(sizes.values())

    def rank_offsets(self, first: int = 1) -> dict[int, int]:
        """Each replica's first rank in a trainer's group whose engine ranks start at ``first``."""
        members = self._ranks or tuple(self.replicas())
        offsets, rank = {}, first
        for m in members:
            offsets[m.index] = rank
            rank += m.ranks
        return offsets

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> FleetResult:
        """vLLM's init for the fleet: each replica joins at its own rank offset (nccl/gloo); an
        empty init_info (ipc) goes to every replica as it is."""
        info = init_info_of(request)
        if not info:
            return self._all(self._verb("init_weight_transfer_engine", body={"init_info": {}}))
        if self._ranks is None:
            self.get_world_size()
        offsets = self.rank_offsets(int(info.get("rank_offset", 1)))
        total = sum(m.ranks for m in self._ranks)
        if int(info["world_size"]) != int(info.get("rank_offset", 1)) + total:
            raise ValueError(f"world_size {info['world_size']} != rank_offset {info.get('rank_offset', 1)} + the "
                             f"fleet's {total} engine ranks")  # fmt: skip
        bodies = {m.index: {"init_info": info | {"rank_offset": offsets[m.index]}} for m in self._ranks}
        return self._all(self._each(self._ranks, "init_weight_transfer_engine", bodies))

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> FleetResult:  # fmt: skip
        """SGLang's init (slime's): replica i at rank offset 1 + the ranks before it."""
        if self._ranks is None:
            self.get_world_size()
        offsets = self.rank_offsets(1)
        body = {"master_address": master_address, "master_port": master_port, "world_size": world_size,
                "group_name": group_name, "backend": backend}  # fmt: skip
        bodies = {m.index: body | {"rank_offset": offsets[m.index]} for m in self._ranks}
        return self._all(self._each(self._ranks, "init_weights_update_group", bodies))

    def update_weights_from_distributed(self, **body: Any) -> FleetResult:
        """SGLang's one-call update, fanned out (inside ``updating()``: slime sends one per bucket)."""
        return self._record(lambda: self._fanout("update_weights_from_distributed", "POST",
                                                 "update_weights_from_distributed", body=body))  # fmt: skip

    def start_weight_update(self, is_checkpoint_format: bool = True) -> FleetResult:
        """Pause the fleet, then open an update on every replica."""
        if self._update is None:
            self._begin("start")
        body = {"is_checkpoint_format": is_checkpoint_format}
        return self._record(lambda: self._verb("start_weight_update", body=body))

    def finish_weight_update(self, weight_version: str | None = None) -> str:
        """Publish one version name on every replica (the next one unless named), then, if the
        update was opened by start_weight_update/update_weights, commit: read the versions back,
        relabel the gateway, resume. Refused, with nothing published, after any failure."""
        update = self._update
        if update is None:
            raise FleetError(FleetResult("finish_weight_update", (), "no fleet update is open"))
        self._settle(update)
        if update.failed:
            raise FleetError(FleetResult("finish_weight_update", (), f"nothing published: replicas "
                                         f"{_indices(update.failed)} failed the update ({_why(update.failed)}); "
                                         "the fleet stays paused"))  # fmt: skip
        version = weight_version or self._next_version()
        self._record(lambda: self._verb("finish_weight_update", body={"weight_version": version}))
        if update.opened_by == "start":
            self._commit()
        return version

    def push(self, sender: Any, weights: Any, weight_version: str | None = None) -> str:
        """One trainer push (a ``WeightSender`` built on this client, ``init()`` done) as one
        transaction; returns the version every replica now serves."""
        self._begin("push")
        try:
            sender.send(weights)
            version = self.finish_weight_update(weight_version)
        except BaseException as e:
            raise self._abandon(e) from e
        self._commit()
        return version

    # -- the transaction's states --------------------------------------------------------

    def _begin(self, opened_by: str) -> None:
        if self._update is not None:
            raise FleetError(FleetResult("update", (), f"a fleet update is already open ({self._update.opened_by})"))
        members = tuple(self.replicas())
        self.pause(**UPDATE_PAUSE)  # a partial pause is undone and raises: nothing was written
        self._update = _Update(members, opened_by)

    def _record(self, call: Callable[[], FleetResult]) -> FleetResult:
        """Run one call of the open update; a replica that fails it becomes a suspect."""
        update = self._update
        if update is None:
            raise FleetError(FleetResult("update", (), "no fleet update is open"))
        with update.settled:
            update.inflight += 1
        try:
            result = call()
            for r in result.failed:
                update.failed[r.index] = r.detail
            seen = {r.index for r in result.replicas}
            for m in update.members:
                if m.index not in seen:  # left the gateway meanwhile: it did not take this call
                    update.failed[m.index] = "not reached (no longer registered)"
            return self._all(result)
        except FleetError:
            raise
        except Exception as e:
            for m in update.members:
                update.failed.setdefault(m.index, f"the call did not complete ({e})")
            raise
        finally:
            with update.settled:
                update.inflight -= 1
                update.settled.notify_all()

    def _settle(self, update: _Update, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Wait for the update's calls still in flight (a sender's background update_weights)."""
        with update.settled:
            update.settled.wait_for(lambda: update.inflight == 0, timeout_s)

    def _abandon(self, error: BaseException) -> FleetError:
        """The update failed: keep the fleet paused, mark who may be torn, and say all of it."""
        update = self._update
        self._update = None
        if update is None:
            return error if isinstance(error, FleetError) else FleetError(FleetResult("update", (), str(error)))
        self._settle(update)
        self.suspects.update(update.failed)
        if not update.failed:  # the trainer's side failed before any replica answered
            for m in update.members:
                self.suspects.setdefault(m.index, f"the update broke off on the trainer's side ({error})")
        rows = tuple(ReplicaResult(m.index, m.url, m.index not in self.suspects,
                                   self.suspects.get(m.index, "ok")) for m in update.members)  # fmt: skip
        return FleetError(FleetResult("weight update", rows, f"nothing resumed: the fleet stays paused ({error})"))

    def _commit(self) -> None:
        update = self._update
        assert update is not None
        self._settle(update)
        if update.failed:
            raise self._abandon(FleetError(FleetResult("weight update", (), "a call failed")))
        self._update = None
        versions = self.weight_versions()
        if len(set(versions.values())) != 1:  # cannot follow from one named publish, but never resume on it
            self.suspects.update({m.index: f"versions differ after the update: {versions}" for m in update.members})
            raise FleetError(FleetResult("weight update", (), f"nothing resumed: the versions differ {versions}"))
        for m in update.members:
            self.suspects.pop(m.index, None)  # every replica took this update whole
        self._relabel(next(iter(versions.values())))
        self.resume()

    def _relabel(self, version: str) -> None:
        """The gateway's registry says the version every replica serves now."""
        for r in self.replicas():
            if r.weight_version != version:
                self.gateway.relabel(r.worker_id, {WEIGHT_VERSION_LABEL: version})

    def _next_version(self) -> str:
        """The name every replica publishes when the caller names none: replicas each advance a
        counter of their own, which a replica restarted, or one that missed an update, would not
        share."""
        versions = set(self.weight_versions().values())
        if all(v.isdigit() for v in versions):
            return str(max(int(v) for v in versions) + 1)
        raise ValueError(f"name the version: the replicas' versions {sorted(versions)} are not all integers")

    def _each(self, members: Sequence[Replica], verb: str, bodies: dict[int, Any]) -> FleetResult:
        """One call per replica, each with its own body, all at once (a group's rendezvous
        completes only when every rank has joined)."""
        with ThreadPoolExecutor(max(1, len(members))) as pool:
            outcomes = list(pool.map(lambda m: self.plane.call(m.worker_id, "POST", verb, body=bodies[m.index]),
                                     members))  # fmt: skip
        by_id = {m.worker_id: m for m in members}
        return FleetResult(verb, tuple(_result(o, by_id) for o in outcomes))

    def close(self) -> None:
        self.plane.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result(outcome: Outcome, members: dict[str, Replica]) -> ReplicaResult:
    member = members.get(outcome.worker_id)
    index = member.index if member is not None else -1
    return ReplicaResult(index, outcome.url or (member.url if member else ""), outcome.ok, outcome.message(),
                         outcome.body)  # fmt: skip


def _with_ranks(replica: Replica, ranks: int) -> Replica:
    return Replica(replica.worker_id, replica.url, replica.index, ranks, replica.health, replica.weight_version,
                   replica.labels)  # fmt: skip


def _indices(items: Any) -> str:
    return ", ".join(str(i) for i in sorted(items))


def _why(failed: dict[int, str]) -> str:
    return "; ".join(f"{i}: {why}" for i, why in sorted(failed.items()))
