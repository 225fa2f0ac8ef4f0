"""The engine's start-up heap, frozen out of the collector's full passes (core/gc_heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from siesta.config import EngineConfig
from siesta.core import engine_core
from siesta.core.engine_core import EngineCore
from siesta.core.gc_heap import freeze_startup_heap


class _Node:
    pass


def _cycle() -> weakref.ref:
    node = _Node()
    node.me = node
    return weakref.ref(node)


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_a_freeze_keeps_the_heap_from_full_passes_and_the_next_one_collects_its_cycles_first(unfrozen) -> None:
    freeze_startup_heap()
    assert gc.get_freeze_count() > 0
    garbage = _cycle()
    freeze_startup_heap()  # collected before the freeze
    assert garbage() is None
    kept = _Node()
    kept.me = kept
    ref = weakref.ref(kept)
    freeze_startup_heap()
    del kept
    gc.collect()
    assert ref() is not None, "a frozen cycle is never walked"
    freeze_startup_heap()
    assert ref() is None, "the next freeze collects it"


@pytest.mark.parametrize("setting, frozen", [(None, False), (True, True), (False, False)])
def test_the_engine_freezes_its_heap_where_configured_and_on_cuda_by_default(monkeypatch, setting, frozen) -> None:
    calls: list[int] = []
    monkeypatch.setattr(engine_core, "freeze_startup_heap", lambda: calls.append(1))
    config = EngineConfig.from_flags(model="random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 20, device="cpu")
    config.freeze_gc_heap = setting
    EngineCore(config)
    assert bool(calls) == frozen
    assert EngineConfig(device="cuda").freezes_gc_heap() and not EngineConfig(device="cpu").freezes_gc_heap()
