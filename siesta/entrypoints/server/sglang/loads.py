"""GET /v1/loads: SGLang's load report, which slime polls after aborting (``?include=core``)
until no request is left before it updates weights.

The shape is SGLang's: ``{timestamp, version, dp_rank_count, loads: [...], aggregate: {...}}``
with one load per data-parallel rank (siesta has one). The request counts are the API server's
own: every engine request it has not seen finish, so a request aborted but not yet reported
still counts, as slime's loop needs; the running ones are the engine's last report, at most
that many. ``include`` names sections (core, memory, spec, lora, disagg, queues, all): siesta
reports the core one whatever is asked; an unknown name is a 400, as SGLang's.
"""

from __future__ import annotations

from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request

from siesta import __version__
from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.state import ServerState, server_state

router = APIRouter(tags=["sglang"])
SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
_RUNNING = "siesta_num_requests_running"
_KV_USAGE = "siesta_kv_cache_usage_perc"


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None, dp_rank: int | None = None) -> dict[str, Any]:
    unknown = sorted({part.strip() for part in (include or "").split(",") if part.strip()} - SECTIONS)
    if unknown:
        raise APIError(HTTPStatus.BAD_REQUEST, f"include names unknown sections {unknown}: expected any of "
                       f"{', '.join(sorted(SECTIONS))}", "include")  # fmt: skip
    state = server_state(request)
    rows = [] if dp_rank not in (None, 0) else [_core_load(state)]
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": __version__,
        "dp_rank_count": len(rows),
        "loads": rows,
        "aggregate": _aggregate(rows),
    }


def _core_load(state: ServerState) -> dict[str, Any]:
    unfinished = sum(1 for s in state.llm.processor.states.values() if not s.finished)
    metrics = state.core.metrics.as_dict()
    running = min(unfinished, int(_gauge(metrics, _RUNNING)))
    info = state.info
    total_tokens = info.num_blocks * info.block_size
    usage = _gauge(metrics, _KV_USAGE)
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": unfinished - running,
        "num_total_reqs": unfinished,
        "num_used_tokens": int(usage * total_tokens),
        "max_total_num_tokens": total_tokens,
        "token_usage": usage,
        "gen_throughput": 0.0,  # not measured here: /metrics has the token counters
        "utilization": usage,
    }


def _aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    count = max(len(rows), 1)
    return {
        "total_running_reqs": sum(r["num_running_reqs"] for r in rows),
        "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in rows),
        "total_reqs": sum(r["num_total_reqs"] for r in rows),
        "total_used_tokens": sum(r["num_used_tokens"] for r in rows),
        "total_tokens": sum(r["max_total_num_tokens"] for r in rows),
        "avg_token_usage": sum(r["token_usage"] for r in rows) / count,
        "avg_throughput": 0.0,
        "avg_utilization": sum(r["utilization"] for r in rows) / count,
    }


def _gauge(metrics: dict[str, float], name: str) -> float:
    """A gauge's value whatever its labels (the served model's name)."""
    return next((v for k, v in metrics.items() if k == name or k.startswith(name + "{")), 0.0)
