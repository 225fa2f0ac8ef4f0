"""MultiConnector: several connectors behind one. Loads come from the first child with
hits; stores go to every child; it keeps its cache across a pause only if every child can."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from siesta.attention.base import KVCache
from siesta.request import Request
from siesta.tiers.base import ConnectorContext, KVConnector, StepTransfers
from siesta.tiers.factory import create_connector


class MultiConnector(KVConnector):
    def __init__(self, extra_config: dict[str, Any], ctx: ConnectorContext, role: str = "kv_both") -> None:
        super().__init__(extra_config, ctx)
        specs = extra_config.get("connectors")
        if not isinstance(specs, list) or not specs:
            raise ValueError("MultiConnector needs kv_connector_extra_config={'connectors': [<kv_transfer_config>, ...]}")
        self.children = [create_connector(spec, ctx) for spec in specs]
        self._loader: dict[str, KVConnector] = {}  # request -> the child it loads from

    @property
    def supports_retained_cache_on_pause(self) -> bool:  # type: ignore[override]
        return all(c.supports_retained_cache_on_pause for c in self.children)

    @property
    def supports_tensor_parallel(self) -> bool:  # type: ignore[override]
        return all(c.supports_tensor_parallel for c in self.children)

    def retention_refusal(self) -> str:
        refusing = [c for c in self.children if not c.supports_retained_cache_on_pause]
        return " ".join(c.retention_refusal() for c in refusing)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self._loader.pop(request.request_id, None)
        for child in self.children:
            n = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n:
                self._loader[request.request_id] = child
                return n
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed: int, num_external: int) -> None:
        loader = self._loader.pop(request.request_id, None)
        for child in self.children:
            # Only the child that matched loads; the others learn the request got 0 tokens from them.
            child.update_state_after_alloc(request, block_ids, num_computed, num_external if child is loader else 0)

    def may_start_loads(self) -> bool:
        return all(c.may_start_loads() for c in self.children)

    def want(self, waiting, token_budget: int) -> None:
        waiting = list(waiting)
        for child in self.children:
            child.want(waiting, token_budget)

    def request_failed(self, request: Request) -> None:
        for child in self.children:
            child.request_failed(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        for child in self.children:
            child.request_finished(request, block_ids)

    def build_step(self, sched) -> StepTransfers:
        return StepTransfers(parts=[(c, c.build_step(sched)) for c in self.children])

    def run_stores(self, transfers: StepTransfers, kv_cache: KVCache) -> None:
        for child, sub in transfers.parts:
            child.run_stores(sub, kv_cache)

    def run_loads(self, transfers: StepTransfers, kv_cache: KVCache) -> None:
        for child, sub in transfers.parts:
            child.run_loads(sub, kv_cache)

    def has_pending_work(self) -> bool:
        return any(c.has_pending_work() for c in self.children)

    def poll(self) -> None:
        for c in self.children:
            c.poll()

    def store_finished(self, request_ids: Collection[str], kv_cache: KVCache) -> None:
        for c in self.children:
            c.store_finished(request_ids, kv_cache)

    def finished_loads(self) -> list[str]:
        return [rid for c in self.children for rid in c.finished_loads()]

    def wait_for_loads(self) -> None:
        for c in self.children:
            c.wait_for_loads()

    def wait_for_progress(self, timeout_s: float) -> None:
        for c in self.children:
            c.wait_for_progress(timeout_s / len(self.children))

    def wait_for_stores(self, kv_cache: KVCache) -> None:
        for c in self.children:
            c.wait_for_stores(kv_cache)

    def set_weight_version(self, version: str) -> None:
        super().set_weight_version(version)
        for c in self.children:
            c.set_weight_version(version)

    def reset_cache(self) -> None:
        for c in self.children:
            c.reset_cache()

    def evict_other_versions(self, keep_version: str) -> None:
        for c in self.children:
            c.evict_other_versions(keep_version)
