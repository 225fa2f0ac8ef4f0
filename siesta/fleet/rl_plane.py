"""smg's RL control plane, as the fleet client calls it: one engine route fanned out to every
replica of a fleet, or passed through to one.

``POST /v1/rl/engine/{path}?selector=...`` sends the same method, query and body to every worker
the selector matches, concurrently, and answers 200 when all answered 2xx, 207 otherwise, with
``results`` (per worker: status, latency, body) and ``failed`` (per worker: ``upstream_error``
with the status, ``upstream_unreachable`` for a replica that is gone). ``/v1/rl/workers/{id}/
engine/{path}`` is the same for one worker: the fleet client uses it where replicas need
different bodies (a weight-transfer group's rank offsets). Nothing here decides anything: the
transactions are ``siesta.fleet.client``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from siesta.fleet.gateway import FLEET_LABEL, RANKS_LABEL, REPLICA_LABEL

# A control call may wait out a weight transfer or a sleep: the gateway's own bound
# (--rl-control-timeout-secs) answers first.
CALL_TIMEOUT_S = 900.0
_PARTIAL = 207


class PlaneError(RuntimeError):
    """The gateway refused the call itself (no replica matched, a bad path): no replica was called."""

    def __init__(self, status: int, payload: Any) -> None:
        detail = payload.get("message", payload) if isinstance(payload, dict) else payload
        super().__init__(f"the gateway answered {status}: {detail}")
        self.status = status
        self.payload = payload


@dataclass(frozen=True)
class Replica:
    """A fleet's replica as the gateway lists it."""

    worker_id: str
    url: str
    index: int
    ranks: int
    health: str
    weight_version: str | None
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_worker(cls, w: dict[str, Any]) -> Replica:
        labels = w.get("labels") or {}
        return cls(str(w["id"]), str(w["url"]), int(labels.get(REPLICA_LABEL, -1)), int(labels.get(RANKS_LABEL, 1)),
                   str(w.get("health")), w.get("weight_version"), dict(labels))  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """One replica's answer to one control call."""

    worker_id: str
    url: str
    status: int | None  # None: the replica could not be reached
    body: Any = None
    error: str | None = None  # the gateway's reason (upstream_error, upstream_unreachable) and message

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300 and self.error is None

    def message(self) -> str:
        if self.ok:
            return "ok"
        body = self.body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):  # siesta's own error shape
            body = body["error"].get("message", body)
        elif isinstance(body, dict) and "message" in body:  # SGLang's {success, message}
            body = body["message"]
        return f"{self.error or 'failed'}: {body}" if body not in (None, "") else str(self.error)


def selector_of(fleet: str, only: Sequence[int] | None = None) -> str:
    """A fleet's replicas, or those of them whose index is in ``only``."""
    selector = f"{FLEET_LABEL}={fleet}"
    if only is not None:
        selector += f",{REPLICA_LABEL} in ({','.join(str(i) for i in sorted(only))})"
    return selector


class RlPlane:
    def __init__(self, gateway_url: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.http = httpx.Client(base_url=gateway_url.rstrip("/"), timeout=timeout_s)

    def replicas(self, fleet: str) -> list[Replica]:
        """The fleet's replicas, by index (the order rank offsets are given in)."""
        response = self.http.get("/v1/rl/workers")
        if response.status_code != 200:
            raise PlaneError(response.status_code, _json(response))
        workers = [w for w in response.json()["workers"] if (w.get("labels") or {}).get(FLEET_LABEL) == fleet]
        return sorted((Replica.from_worker(w) for w in workers), key=lambda r: (r.index, r.url))

    def fanout(self, fleet: str, method: str, path: str, params: dict[str, Any] | None = None,
               body: Any = None, only: Sequence[int] | None = None) -> list[Outcome]:  # fmt: skip
        """Every replica's outcome (one per replica the selector matched)."""
        query = [("selector", selector_of(fleet, only)), *_query(params)]
        response = self.http.request(method, f"/v1/rl/engine/{path.lstrip('/')}", params=query,
                                     json=body if method != "GET" else None)  # fmt: skip
        payload = _json(response)
        if response.status_code not in (200, _PARTIAL) or not isinstance(payload, dict) or "results" not in payload:
            raise PlaneError(response.status_code, payload)
        return _outcomes(payload)

    def call(self, worker_id: str, method: str, path: str, params: dict[str, Any] | None = None,
             body: Any = None) -> Outcome:  # fmt: skip
        response = self.http.request(method, f"/v1/rl/workers/{quote(worker_id)}/engine/{path.lstrip('/')}",
                                     params=_query(params), json=body if method != "GET" else None)  # fmt: skip
        payload = _json(response)
        if isinstance(payload, dict) and "latency_ms" in payload:  # the engine answered (any status)
            status = int(payload.get("status", response.status_code))
            error = None if 200 <= status < 300 else "upstream_error"
            return Outcome(worker_id, str(payload.get("url", "")), status, payload.get("body"), error)
        if isinstance(payload, dict) and payload.get("error") in ("upstream_unreachable", "upstream_timeout"):
            return Outcome(worker_id, "", None, None, f"{payload['error']}: {payload.get('message', '')}")
        raise PlaneError(response.status_code, payload)

    def close(self) -> None:
        self.http.close()


def _query(params: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Engine query parameters as siesta reads them: booleans as true/false, lists repeated."""
    out: list[tuple[str, str]] = []
    for name, value in (params or {}).items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            out.append((name, ("true" if v else "false") if isinstance(v, bool) else str(v)))
    return out


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _outcomes(payload: dict[str, Any]) -> list[Outcome]:
    failed = {f["worker_id"]: f for f in payload.get("failed") or []}
    out = []
    for worker_id, r in (payload.get("results") or {}).items():
        f = failed.pop(worker_id, None)
        error = None if f is None else f"{f.get('error')}"
        out.append(Outcome(worker_id, str(r.get("url", "")), int(r.get("status", 0)), r.get("body"), error))
    for worker_id, f in failed.items():  # no answer at all: unreachable, timed out
        out.append(Outcome(worker_id, str(f.get("url", "")), f.get("status"), None,
                           f"{f.get('error')}: {f.get('message', '')}"))  # fmt: skip
    return out
