"""The offloading connector inside a real engine: the seed's behaviour and beyond.

A tiny random Llama keeps these fast; token identity is checked against the same
engine's uninterrupted runs (itself checked against transformers elsewhere).
"""

from __future__ import annotations

import functools
import random
import shutil
import time

import pytest

from siesta import LLM, SamplingParams
from siesta.control import ConnectorRetentionError
from siesta.kv.hashing import extend_block_hashes
from siesta.tiers.base import DropReason
from siesta.tiers.copy_feeder import CopyFeeder
from siesta.tiers.disk_tier import DiskTier

BLOCK = 16
TIER_BLOCK = 32
BLOCK_BYTES_FP32 = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny-llama: layers x (K, V) x tokens x kv heads x head dim x 4 B
MODEL = "random:tiny-llama"


def offload(**extra) -> dict:
    cfg = {"block_size": TIER_BLOCK, "cpu_bytes_to_use": 1 << 26} | extra
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def engine(kv_transfer_config=None, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_bytes": 1 << 23, "max_model_len": 1024} | kw
    return LLM(MODEL, kv_transfer_config=kv_transfer_config, **kw)


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths 8 past a tier block (32 tokens) with 8 new tokens: the output never fills another
    # tier block, so what the warm-up stores is exactly what a replay can load.
    return [[rng.randrange(3, 900) for _ in range(TIER_BLOCK * (5 + i) + 8)] for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=8)
SHORT = SamplingParams(temperature=0, max_tokens=2)  # where the prompts' KV is all that matters


def generate(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


def counters(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.get_metrics().items() if "offload" in k or "prefix_cache" in k}


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


HITS = "siesta_external_prefix_cache_hits_total"
QUERIES = "siesta_external_prefix_cache_queries_total"
LOADS = 'siesta_kv_offload_load_bytes_total{tier="host"}'
STORES = 'siesta_kv_offload_store_bytes_total{tier="host"}'
DISK_LOADS = 'siesta_kv_offload_load_bytes_total{tier="disk"}'
LOAD_SECONDS = 'siesta_kv_offload_load_seconds_total{tier="host"}'


DROPPED = "siesta_kv_offload_dropped_stores_total"


def dropped(metrics: dict[str, float]) -> dict[tuple[str, str], float]:
    """(tier, reason) -> stores dropped, for every label pair that counted any."""
    out = {}
    for key, value in metrics.items():
        if key.startswith(DROPPED + "{") and value:
            labels = dict(part.split("=") for part in key[len(DROPPED) + 1 : -1].split(","))
            out[(labels["tier"].strip('"'), labels["reason"].strip('"'))] = value
    return out


def full_blocks_before_last_token(ps: list[list[int]]) -> int:
    return sum((len(p) - 1) // BLOCK * BLOCK for p in ps)


# -- seed parity -------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("via", ["sleep", "pause"])
def test_kept_tier_replay_loads_what_warmup_stored(via, async_scheduling):
    llm = engine(offload(), async_scheduling=async_scheduling)
    ps = prompts()
    c0 = counters(llm)
    ref = generate(llm, ps)
    c1 = counters(llm)
    stored = delta(c1, c0, STORES)
    assert stored > 0
    assert delta(c1, c0, LOAD_SECONDS) == 0, "nothing was loaded"
    t0 = time.perf_counter()
    if via == "sleep":
        llm.sleep(level=1, clear_connector_cache=False)
        llm.wake_up()
    else:
        llm.pause(clear_connector_cache=False)
        llm.resume()
    assert generate(llm, ps) == ref
    replay_s = time.perf_counter() - t0
    c2 = counters(llm)
    assert 0 < delta(c2, c1, LOAD_SECONDS) <= replay_s, "the loads' own seconds, within the replay's"
    assert delta(c2, c1, HITS) == full_blocks_before_last_token(ps)
    assert delta(c2, c1, QUERIES) == sum(map(len, ps))
    assert delta(c2, c1, LOADS) == stored
    assert delta(c2, c1, STORES) == 0
    assert delta(c2, c1, "siesta_prefix_cache_hits_total") == 0  # the device cache went with the pause


def test_a_replay_loads_each_tier_entry_in_one_copy(monkeypatch):
    """The replay's device blocks are consecutive ids (the pool hands them out ascending), so
    a tier entry moves in one copy, not one per device block."""
    from siesta.tiers import transfer

    # Room for the prompts about one and a half times: the replay reuses blocks the warm-up
    # freed, tail first as every request frees them.
    llm = engine(offload(), kv_cache_bytes=96 * BLOCK_BYTES_FP32, max_model_len=512)
    ps = prompts()
    generate(llm, ps)
    assert llm.engine.runner.kv_cache.block_bytes == BLOCK_BYTES_FP32
    c1 = counters(llm)
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    runs: list[int] = []
    run_parts = transfer._run_parts

    def counted(cache, ids, host, direction):  # every path's copies: one a run of consecutive blocks
        if direction == "in":
            runs.append(len(transfer.block_runs(ids)))
        return run_parts(cache, ids, host, direction)

    monkeypatch.setattr(transfer, "_run_parts", counted)
    generate(llm, ps)
    entries = delta(counters(llm), c1, LOADS) // llm.engine.connector.host.entry_bytes
    assert entries == sum((len(p) - 1) // TIER_BLOCK for p in ps) > 0
    # A request whose blocks come from two free ranges (never used, and freed) splits at most
    # one entry between them; blocks handed out in free-list order made 32 copies here.
    assert entries <= sum(runs) <= entries + len(ps)


@pytest.mark.parametrize("call", ["sleep_default", "pause_default", "sleep_explicit"])
def test_omitted_or_true_clears_the_tier(call):
    llm = engine(offload())
    ps = prompts()
    ref = generate(llm, ps)
    c1 = counters(llm)
    if call == "sleep_default":
        llm.sleep(level=1)
        llm.wake_up()
    elif call == "pause_default":
        llm.pause()
        llm.resume()
    else:
        llm.sleep(level=1, clear_connector_cache=True)
        llm.wake_up()
    assert generate(llm, ps) == ref
    c2 = counters(llm)
    assert delta(c2, c1, HITS) == 0
    # With the tier cleared the replay stores the same blocks all over again.
    assert delta(c2, c1, STORES) == delta(c1, {}, STORES)


# -- the seed's crash: preempted by the pause, resumed in the step that reports it --------


class StepRecorder:
    """Sees, per step, the preemptions it reports and the loads its schedule started (a load
    starts when its request is admitted, before the step's plan is built)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[set[str], set[str]]] = []
        connector = llm.engine.connector
        original, submit = connector.build_step, connector.loads.submit
        started: set[str] = set()

        def record_load(job_id, *args, **kwargs):
            started.add(job_id)
            return submit(job_id, *args, **kwargs)

        def build_step(sched):
            transfers = original(sched)
            self.steps.append((set(sched.preempted_req_ids), set(started)))
            started.clear()
            return transfers

        connector.loads.submit = record_load
        connector.build_step = build_step


MAX_RESUME_STEPS = 400


@pytest.mark.parametrize("chunked", [True, False])
def test_keep_mode_sleep_resumes_by_loading_in_the_reporting_step(chunked):
    kw = {} if chunked else {"enable_chunked_prefill": False}
    if chunked:
        kw["max_num_batched_tokens"] = 64  # prompts prefill over several steps
    ps = prompts(3, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = generate(engine(**kw), ps, params)

    llm = engine(offload(), **kw)
    recorder = StepRecorder(llm)
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in ps]
    for _ in range(12 if chunked else 6):  # mid-generation: some tokens out, more to come
        llm.step()
    assert llm.has_unfinished_requests()
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    llm.wake_up()
    outs = {}
    # Bounded: without the same-step resume fix the engine steps for ever (it once ran to the
    # suite's timeout); a few times the steps a clean run needs is plenty.
    for _ in range(MAX_RESUME_STEPS):
        if not llm.has_unfinished_requests():
            break
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert not llm.has_unfinished_requests(), f"still unfinished after {MAX_RESUME_STEPS} steps"
    assert [outs[i] for i in ids] == ref
    resumed_with_load = [pre & loads for pre, loads in recorder.steps if pre & loads]
    assert resumed_with_load, "no request was preempted and loaded in the same step"
    assert llm.get_metrics()[HITS] > 0


# -- fail-closed ---------------------------------------------------------------------------


NO_RETENTION = {
    "kv_connector": "NoRetentionConnector",
    "kv_connector_module_path": "tiers.no_retention_connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24},
}


@pytest.mark.parametrize(
    "cfg",
    [
        NO_RETENTION,
        {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [offload(), NO_RETENTION]}},
    ],
    ids=["third_party", "multi_with_one_refusing_child"],
)
def test_refusal_leaves_the_engine_untouched(cfg):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent))
    llm = engine(cfg)
    ps = prompts(2)
    generate(llm, ps)
    before = counters(llm)
    used = before['siesta_kv_offload_bytes_used{tier="host"}']
    assert used > 0
    for call in (lambda: llm.sleep(level=1, clear_connector_cache=False),
                 lambda: llm.pause(mode="keep", clear_connector_cache=False)):  # fmt: skip
        with pytest.raises(ConnectorRetentionError) as err:
            call()
        assert "NoRetentionConnector" in str(err.value) and "clear_connector_cache=False" in str(err.value)
        assert not llm.is_paused() and not llm.is_sleeping()
    after = counters(llm)
    assert after['siesta_kv_offload_bytes_used{tier="host"}'] == used
    # Still serving, and still hitting the device prefix cache that was never reset.
    generate(llm, ps)
    assert delta(counters(llm), after, "siesta_prefix_cache_hits_total") > 0


def test_no_connector_means_nothing_to_refuse():
    llm = engine()
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    assert generate(llm, prompts(1))


# -- weight versions ---------------------------------------------------------------------


def test_new_weight_version_never_hits_old_entries_and_finish_evicts_them():
    llm = engine(offload())
    ps = prompts()
    generate(llm, ps)
    weights = list(llm.engine.source.iter_weights(llm.engine.runner.dtype))
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up(["weights"])
    assert llm.update_weights(weights) == "1"
    llm.wake_up(["kv_cache"])
    c1 = counters(llm)
    generate(llm, ps)
    c2 = counters(llm)
    assert delta(c2, c1, HITS) == 0 and delta(c2, c1, STORES) > 0
    assert llm.get_metrics()['siesta_weight_version_info{version="1"}'] == 1
    host_used = c2['siesta_kv_offload_bytes_used{tier="host"}']
    llm.finish_weight_update()
    c3 = counters(llm)
    # Only version 1's entries (stored by the replay) survive.
    assert c3['siesta_kv_offload_bytes_used{tier="host"}'] == delta(c2, c1, STORES) < host_used


def test_naming_the_same_version_keeps_the_name_and_no_entries():
    # Written weights are new weights to the engine, whatever they are named: it cannot tell
    # equal weights from different ones without reading every byte (core/weight_versions.py).
    llm = engine(offload())
    ps = prompts()
    ref = generate(llm, ps)
    weights = list(llm.engine.source.iter_weights(llm.engine.runner.dtype))
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up(["weights"])
    assert llm.update_weights(weights, weight_version=llm.weight_version) == "0"
    llm.wake_up(["kv_cache"])
    llm.finish_weight_update()
    c1 = counters(llm)
    assert generate(llm, ps) == ref  # the same weights: the same tokens, computed again
    c2 = counters(llm)
    assert delta(c2, c1, HITS) == 0 and delta(c2, c1, STORES) > 0


def test_outputs_carry_the_weight_version():
    llm = engine()
    llm.update_weights(llm.engine.source.iter_weights(llm.engine.runner.dtype), weight_version="rl-step-7")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert out.weight_version == "rl-step-7"


# -- disk tier ---------------------------------------------------------------------------


def test_restarted_engine_reuses_disk_entries(tmp_path):
    cfg = offload(disk_path=str(tmp_path), disk_bytes_to_use=1 << 26)
    ps = prompts()
    first = engine(cfg)
    ref = generate(first, ps)
    first.engine.connector.wait_for_stores(first.engine.runner.kv_cache)
    disk_stored = counters(first)['siesta_kv_offload_store_bytes_total{tier="disk"}']
    assert disk_stored > 0
    del first
    second = engine(cfg)
    assert generate(second, ps) == ref
    c = counters(second)
    assert c[HITS] == full_blocks_before_last_token(ps)
    assert c['siesta_kv_offload_load_bytes_total{tier="disk"}'] > 0


def test_multi_connector_loads_from_first_child_with_hits_and_stores_to_all(tmp_path):
    disk_only_host = offload(disk_path=str(tmp_path), disk_bytes_to_use=1 << 26)
    cfg = {"kv_connector": "MultiConnector",
           "kv_connector_extra_config": {"connectors": [offload(), disk_only_host]}}  # fmt: skip
    llm = engine(cfg)
    assert llm.engine.connector.supports_retained_cache_on_pause
    ps = prompts()
    ref = generate(llm, ps)
    first, second = llm.engine.connector.children
    assert len(first.host) == len(second.host) > 0
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    c1 = counters(llm)
    assert generate(llm, ps) == ref
    c2 = counters(llm)
    assert delta(c2, c1, HITS) == full_blocks_before_last_token(ps)
    # Each hit was loaded once, from the first child.
    assert delta(c2, c1, LOADS) == delta(c2, c1, HITS) * first.ctx.block_bytes // BLOCK


def test_offload_prompt_only_skips_generated_blocks():
    ps = [p[: BLOCK * 4] for p in prompts(2)]  # prompts end on a block boundary
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    all_blocks, prompt_only = engine(offload(block_size=16)), engine(offload(block_size=16, offload_prompt_only=True))
    generate(all_blocks, ps, params)
    generate(prompt_only, ps, params)
    per_block = all_blocks.engine.connector.host.entry_bytes
    assert counters(prompt_only)[STORES] == 2 * 4 * per_block
    assert counters(all_blocks)[STORES] == 2 * ((4 * BLOCK + 39) // BLOCK) * per_block


def test_tier_budget_holds_under_a_random_workload():
    rng = random.Random(3)
    llm = engine(offload(block_size=16, cpu_bytes_to_use=40 * 16 * 512))
    cap = llm.get_metrics()['siesta_kv_offload_bytes_capacity{tier="host"}']
    for round_ in range(6):
        ps = [[rng.randrange(3, 900) for _ in range(rng.randrange(20, 300))] for _ in range(rng.randrange(1, 6))]
        generate(llm, ps + [p[: len(p) // 2] for p in ps])
        m = llm.get_metrics()
        assert m['siesta_kv_offload_bytes_used{tier="host"}'] <= cap
        if round_ % 2:
            llm.sleep(level=1, clear_connector_cache=False)
            llm.wake_up()
    assert llm.get_metrics()['siesta_kv_offload_evictions_total{tier="host"}'] > 0


def test_update_weights_from_a_model_path(tmp_path):
    """A trainer's checkpoint directory works as well as (name, tensor) pairs."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = engine()
    ps = prompts(2)
    ref = generate(llm, ps)
    source = llm.engine.source
    hf = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32)
    state = dict(source.iter_weights(torch.float32, "cpu"))
    # The "trained" weights differ: layer 0's MLP now pushes the other way.
    state["model.layers.0.mlp.down_proj.weight"] = -state["model.layers.0.mlp.down_proj.weight"]
    hf.load_state_dict(state, strict=False)
    hf.save_pretrained(tmp_path)
    assert llm.update_weights(str(tmp_path), weight_version="trained") == "trained"
    changed = generate(llm, ps)
    assert changed != ref
    # And back: the original weights give the original tokens again.
    llm.update_weights(source.iter_weights(torch.float32, "cpu"), weight_version="original")
    assert generate(llm, ps) == ref


# -- loads issued through a window -------------------------------------------------------


class _Held:
    """A copy handle that lands only when the test says so."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed


class HeldCopier:
    """The real (CPU) copier, except that loads count as landed only once released."""

    cuda = False

    def __init__(self, real) -> None:
        self.real = real
        self.loads: list[tuple[_Held, int]] = []  # (handle, blocks) in issue order
        self.block_ids: list[list[int]] = []  # each load's device blocks, in issue order

    def load(self, pieces, kv, after=None):
        self.real.load(pieces, kv)
        handle = _Held()
        self.loads.append((handle, sum(len(ids) for _, ids in pieces)))
        self.block_ids.append([b for _, ids in pieces for b in ids])
        return handle

    def store(self, kv, block_ids, dst):
        return self.real.store(kv, block_ids, dst)

    @staticmethod
    def done(handle) -> bool:
        return handle is None or not isinstance(handle, _Held) or handle.landed

    @staticmethod
    def wait(handle) -> None:
        if isinstance(handle, _Held):
            handle.landed = True

    @staticmethod
    def wait_for(handle, timeout_s: float) -> None:
        """A bounded wait lands nothing: only the test does."""

    @staticmethod
    def ready_event(handle):
        return handle


def test_loads_go_out_a_window_at_a_time_and_the_request_waits_for_the_last():
    llm = engine()  # block bytes first, to size the window in whole pieces
    piece_bytes = (TIER_BLOCK // BLOCK) * llm.engine.runner.kv_cache.block_bytes
    llm = engine(offload(load_window_bytes=piece_bytes))
    ps = prompts(1)
    ref = generate(llm, ps)
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    connector = llm.engine.connector
    held = HeldCopier(connector.copier)
    # Driven by the engine's polls alone (no feeder thread, which would wait the copies out).
    connector.loads = CopyFeeder(held, "in", connector.cfg.load_window_bytes, piece_bytes // (TIER_BLOCK // BLOCK),
                                 threaded=False)  # fmt: skip
    rid = llm.add_request({"prompt_token_ids": ps[0]}, GREEDY)
    pieces = (len(ps[0]) - 1) // TIER_BLOCK
    scheduler = llm.engine.scheduler
    for issued in range(1, pieces + 1):
        llm.step()
        assert len(held.loads) == issued, "one piece's bytes in flight at a time"
        assert rid in scheduler.loading, "no compute before the last chunk lands"
        llm.step()  # nothing landed: nothing more goes out
        assert len(held.loads) == issued
        held.loads[-1][0].landed = True
    outputs = []
    while llm.engine.has_work():
        outputs.extend(o for o in llm.step() if o.finished)
    assert [blocks for _, blocks in held.loads] == [TIER_BLOCK // BLOCK] * pieces
    assert outputs[0].outputs[0].token_ids == ref[0]


def _held_loads(llm: LLM, piece_bytes: int) -> HeldCopier:
    """The connector's loads through a held copier, one tier piece in flight at a time, driven
    by the engine's polls alone (no feeder thread, which would wait the copies out)."""
    connector = llm.engine.connector
    held = HeldCopier(connector.copier)
    block_bytes = llm.engine.runner.kv_cache.block_bytes
    connector.loads = CopyFeeder(held, "in", piece_bytes, block_bytes, threaded=False)
    return held


def _joining_ahead(monkeypatch, num_prompts: int):
    """An engine resumed from its tier over ``num_prompts`` prompts, its loads held one piece at a
    time, whose landings it predicts (the rate their first landings showed), every step scheduled
    with a lead of 10 s. Returns the engine, the prompts, their uninterrupted tokens, the held
    copier, and per launched step the requests it computes and the events it waits for."""
    llm = engine()
    piece_bytes = (TIER_BLOCK // BLOCK) * llm.engine.runner.kv_cache.block_bytes
    llm = engine(offload(load_window_bytes=piece_bytes))
    ps = prompts(num_prompts)
    ref = _resumed(llm, ps)
    held = _held_loads(llm, piece_bytes)
    llm.engine.connector.load_feeder = llm.engine.connector.loads
    monkeypatch.setattr(llm.engine, "_join_within_s", lambda: 10.0)
    launched: list[tuple[set[str], list]] = []
    launch = llm.engine.runner.launch

    def spy(sched, *args, **kwargs):
        launched.append(({item.request.request_id for item in sched.scheduled}, list(sched.transfers.waits)))
        return launch(sched, *args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "launch", spy)
    return llm, ps, ref, held, launched


def test_a_request_expected_to_land_before_its_step_starts_joins_it_and_the_step_waits_for_the_landing(monkeypatch):
    llm, ps, ref, held, launched = _joining_ahead(monkeypatch, 1)
    scheduler = llm.engine.scheduler
    rid = llm.add_request({"prompt_token_ids": ps[0]}, GREEDY)
    pieces = (len(ps[0]) - 1) // TIER_BLOCK
    llm.step()
    while rid in scheduler.loading:
        assert len(held.loads) < pieces, "joined once its last piece went out, not after"
        held.loads[-1][0].landed = True
        llm.step()
    last = held.loads[-1][0]
    assert len(held.loads) == pieces and not last.landed
    assert scheduler.landing == {rid}, "running before its loads landed"
    first_step = next(i for i, (ids, _) in enumerate(launched) if rid in ids)
    assert launched[first_step][1] == [last], "the step that computes it first waits for its last piece"
    assert all(not waits for _, waits in launched[first_step + 1 :])
    outputs = []
    while llm.engine.has_work():
        last.landed = True
        outputs.extend(o.outputs[0].token_ids for o in llm.step() if o.finished)
    assert not scheduler.landing
    assert outputs == ref


def test_a_request_that_joined_ahead_keeps_its_blocks_until_its_loads_land(monkeypatch):
    llm, ps, ref, held, _ = _joining_ahead(monkeypatch, 2)
    scheduler, pool = llm.engine.scheduler, llm.engine.kv.pool
    free_before = pool.num_free_blocks
    rid = llm.add_request({"prompt_token_ids": ps[0]}, GREEDY)
    llm.step()
    while rid not in scheduler.landing:
        held.loads[-1][0].landed = True
        llm.step()
    last = held.loads[-1][0]
    freed = []
    free = pool.free
    monkeypatch.setattr(pool, "free", lambda blocks: freed.append(last.landed) or free(blocks))
    llm.abort([rid])
    assert freed and all(freed), "its blocks went back only after its last copy landed"
    assert not scheduler.landing and pool.num_free_blocks == free_before
    ids = [llm.add_request({"prompt_token_ids": p}, GREEDY) for p in ps]  # the engine goes on
    outputs = {}
    while llm.engine.has_work():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
        for handle, _ in held.loads:
            handle.landed = True
    assert [outputs[i] for i in ids] == ref


def _resumed(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    ref = generate(llm, ps)
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    return ref


def test_generate_starts_the_first_prompts_loads_before_it_adds_the_rest(monkeypatch):
    # A device that runs ahead (async scheduling) and a first prompt that fills a step's budget.
    llm = engine(offload(), async_scheduling=True, max_num_batched_tokens=4 * TIER_BLOCK)
    ps = prompts(3)
    ref = _resumed(llm, ps)
    added: list[str] = []
    adds_at_loads: list[int] = []  # requests added when each load job started
    connector = llm.engine.connector
    add, start_load = llm.engine.add_requests, connector._start_load
    monkeypatch.setattr(llm.engine, "add_requests", lambda reqs: (add(reqs), added.extend(reqs)))
    monkeypatch.setattr(connector, "_start_load", lambda *a, **k: (adds_at_loads.append(len(added)), start_load(*a, **k)))
    assert generate(llm, ps) == ref
    assert adds_at_loads == [1, 3, 3], "the first prompt's loads began before the second prompt was added"


def test_loads_start_at_admission_in_request_order_and_a_loaded_request_runs_before_later_ones_land():
    llm = engine()
    piece_bytes = (TIER_BLOCK // BLOCK) * llm.engine.runner.kv_cache.block_bytes
    llm = engine(offload(load_window_bytes=piece_bytes))
    ps = prompts(3)
    ref = _resumed(llm, ps)
    held = _held_loads(llm, piece_bytes)
    scheduler = llm.engine.scheduler
    ids = [llm.add_request({"prompt_token_ids": p}, GREEDY) for p in ps]
    llm.step()
    # One schedule looked every request up and started its loads (the default lookahead is far
    # above these few KiB); the window lets one piece out.
    assert set(scheduler.loading) == set(ids) and len(held.loads) == 1
    owner = {}
    for rid in ids:
        owner.update((b, rid) for b in llm.engine.kv.block_ids(rid))
    pieces = {rid: (len(p) - 1) // TIER_BLOCK for rid, p in zip(ids, ps)}
    runnable_while_loading: dict[str, set[str]] = {}
    outputs = {}
    while scheduler.loading:
        held.loads[-1][0].landed = True
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
        for rid in ids:
            if rid not in scheduler.loading and rid not in runnable_while_loading:
                runnable_while_loading[rid] = set(scheduler.loading)
    issued_for = [owner[ids_[0]] for ids_ in held.block_ids]
    assert issued_for == [rid for rid in ids for _ in range(pieces[rid])], "each request's loads before the next's"
    # Runnable the step after its own last piece landed, while the later requests still load.
    assert runnable_while_loading[ids[0]] == {ids[1], ids[2]}
    assert runnable_while_loading[ids[1]] == {ids[2]}
    while llm.engine.has_work():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
    assert [outputs[i] for i in ids] == ref


def test_lookups_wait_while_the_loads_started_fill_the_lookahead():
    llm = engine()
    piece_bytes = (TIER_BLOCK // BLOCK) * llm.engine.runner.kv_cache.block_bytes
    llm = engine(offload(load_window_bytes=piece_bytes, load_lookahead_bytes=piece_bytes))
    ps = prompts(2)
    ref = _resumed(llm, ps)
    held = _held_loads(llm, piece_bytes)
    scheduler = llm.engine.scheduler
    first, second = (llm.add_request({"prompt_token_ids": p}, GREEDY) for p in ps)
    llm.step()
    assert list(scheduler.loading) == [first], "the first request's loads fill the lookahead"
    assert [r.request_id for r in scheduler.waiting] == [second], "the second is not looked up yet"
    while first in scheduler.loading:
        held.loads[-1][0].landed = True
        llm.step()
    # Its last piece landed: the backlog is empty, so the same schedule that let the first
    # request run looked the second one up and started its loads.
    assert second in scheduler.loading
    assert llm.engine.kv.block_ids(second)[0] in held.block_ids[-1]
    outputs = {}
    while llm.engine.has_work():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
        for handle, _ in held.loads:
            handle.landed = True
    assert [outputs[first], outputs[second]] == ref


def test_a_step_s_copies_wait_for_the_compute_mark_it_carries():
    # The runner marks the step's transfers before its forward and issues them after it, so
    # the copies must wait for that mark, not for whatever is queued when they are issued.
    # Loads start at admission, inside schedule(), before that step's forward is queued: they
    # wait for a mark taken as they are submitted (every forward queued by then).
    llm = engine(offload())
    connector, kv = llm.engine.connector, llm.engine.runner.kv_cache
    seen: dict[str, list] = {"in": [], "out": []}
    for feeder in (connector.loads, connector.stores):
        submit = feeder.submit

        def spy(job_id, parts, kv_cache, issue=True, after=None, submit=submit, direction=feeder.direction):
            seen[direction].append(after)
            return submit(job_id, parts, kv_cache, issue=issue, after=after)

        feeder.submit = spy
    ps = prompts(1)
    rid = llm.add_request({"prompt_token_ids": ps[0]}, GREEDY)
    sched = llm.engine.scheduler.schedule()  # the prefill fills full blocks: the next step stores them
    llm.engine.scheduler.update(sched, llm.engine.runner.execute(sched), "0")
    sched = llm.engine.scheduler.schedule()
    assert sched.transfers.stores
    mark = object()
    sched.transfers.mark(mark)
    connector.run_stores(sched.transfers, kv)
    assert seen["out"] and all(after is mark for after in seen["out"])
    llm.abort([rid])
    connector.wait_for_stores(kv)

    generate(llm, ps)
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    marks_taken = []
    take_mark = connector.loads.compute_mark
    connector.loads.compute_mark = lambda: marks_taken.append(take_mark()) or marks_taken[-1]
    llm.add_request({"prompt_token_ids": ps[0]}, GREEDY)
    sched = llm.engine.scheduler.schedule()
    assert seen["in"] == [None] and len(marks_taken) == 1, "submitted by the lookup, the mark taken then"
    assert not sched.transfers.loads, "no step carries a load started at admission"


def test_a_mark_reaches_every_child_share_of_a_composite_step():
    from siesta.tiers.base import StepTransfers

    first, second = StepTransfers(loads=["a"]), StepTransfers(stores=["b"], parts=[(None, StepTransfers())])
    step = StepTransfers(parts=[(None, first), (None, second)])
    mark = object()
    step.mark(mark)
    assert step.after is mark and first.after is mark and second.after is mark
    assert second.parts[0][1].after is mark


def test_a_small_host_tier_over_a_disk_tier_drops_no_store(tmp_path, monkeypatch):
    """Host slots wait for their disk writes; a store waits for a slot instead of being dropped
    while the disk has room, so every stored prefix is found again (found by a chaos probe:
    379 of 756 stores dropped with a 64 MiB host tier over a disk tier)."""
    import time

    probe = engine(offload())
    entry_bytes = probe.engine.connector.host.entry_bytes
    del probe
    real_write = DiskTier.write

    def slow_write(self, *args):
        time.sleep(0.02)  # a disk slower than the host copies: every slot stays pinned a while
        return real_write(self, *args)

    monkeypatch.setattr(DiskTier, "write", slow_write)
    # Room for one prompt's entries (at most 10) but not for the 45 that six prompts store.
    llm = engine(offload(cpu_bytes_to_use=12 * entry_bytes, disk_path=str(tmp_path), disk_bytes_to_use=1 << 26))
    ps = prompts(6)
    ref = generate(llm, ps)
    llm.engine.connector.wait_for_stores(llm.engine.runner.kv_cache)
    c1 = counters(llm)
    assert dropped(c1) == {}
    assert c1['siesta_kv_offload_store_bytes_total{tier="disk"}'] > 0
    llm.reset_prefix_cache()  # the device cache forgets: only the tiers remember
    assert [generate(llm, [p])[0] for p in ps] == ref  # one at a time: each one's loads fit the host tier
    assert delta(counters(llm), c1, HITS) == sum((len(p) - 1) // TIER_BLOCK * TIER_BLOCK for p in ps)


def test_a_default_sleep_and_a_finished_weight_update_clear_the_disk_tier_too(tmp_path):
    llm = engine(offload(disk_path=str(tmp_path), disk_bytes_to_use=1 << 26))
    connector = llm.engine.connector
    ps = prompts()
    generate(llm, ps)
    connector.wait_for_stores(llm.engine.runner.kv_cache)
    assert len(connector.disk) > 0
    llm.sleep(level=1)  # clear_connector_cache defaults to true: the disk tier goes too
    llm.wake_up()
    assert len(connector.disk) == 0
    c1 = counters(llm)
    generate(llm, ps)
    assert delta(counters(llm), c1, HITS) == 0
    connector.wait_for_stores(llm.engine.runner.kv_cache)
    assert len(connector.disk) > 0  # version 0's entries, stored again
    llm.update_weights(list(llm.engine.source.iter_weights(llm.engine.runner.dtype)))
    llm.finish_weight_update()  # version 1: version 0's entries leave the disk as well
    assert len(connector.disk) == 0


def test_a_full_host_tier_keeps_what_it_holds_reachable():
    """Evicting chain ends first: every entry the host tier keeps is found by a lookup (its
    chain's earlier entries are kept too), however many requests overflowed it."""
    probe = engine(offload())
    entry_bytes = probe.engine.connector.host.entry_bytes
    del probe
    llm = engine(offload(cpu_bytes_to_use=12 * entry_bytes))
    generate(llm, prompts(6))
    llm.engine.connector.wait_for_stores(llm.engine.runner.kv_cache)
    host = llm.engine.connector.host
    assert host.evictions > 0 and len(host) == 12
    stranded = [k for k, e in host._index.items() if e.parent is not None and not host.contains(e.parent)]
    assert not stranded


# -- a small host tier over a small disk tier ----------------------------------------------


@functools.cache
def entry_bytes() -> int:
    """Bytes of one tier entry (TIER_BLOCK tokens of every layer's K and V) of MODEL."""
    return engine(offload()).engine.connector.host.entry_bytes


def disk_file_bytes(root) -> int:
    """The size of one entry's file on a disk tier, its header included."""
    parent, key = bytes(16), bytes([1]) * 16  # as long as real keys
    probe = DiskTier(root, "probe", 1 << 30, entry_bytes())
    data = memoryview(bytes(entry_bytes()))
    probe.write(parent, "0", data)
    return probe.write(key, "0", data, parent=parent).nbytes


def tier_keys(llm: LLM, p: list[int]) -> list[bytes]:
    """The tier keys of the prompt's full tier blocks, in chain order."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, p, BLOCK, llm.engine._hash_extra(None))
    k = TIER_BLOCK // BLOCK
    return [hashes[(j + 1) * k - 1] for j in range(len(hashes) // k)]


def tier_reachable_tokens(llm: LLM, p: list[int]) -> int:
    """Brute force over what the tiers hold: the tokens a lookup of ``p`` can find, from its
    first entry up to the first one neither tier holds (the last token is always computed)."""
    connector = llm.engine.connector
    found = 0
    for key in tier_keys(llm, p):
        if not (connector.host.contains(key) or (connector.disk is not None and connector.disk.contains(key))):
            break
        found += 1
    return min(found * TIER_BLOCK, (len(p) - 1) // BLOCK * BLOCK)


def test_more_prefixes_than_a_small_disk_tier_holds_are_found_again_where_kept(tmp_path):
    """Four prompts (18 entries) through 6 host slots onto a disk of 10 entries: the disk
    evicts chain ends to make room, so no store is dropped, every entry it keeps is reachable
    from its chain's start, and each prompt then loads exactly what the tiers kept of it:
    from the host tier, from the disk, a whole chain or a prefix of one."""
    host_room, disk_room = 6, 10
    file_bytes = disk_file_bytes(tmp_path / "probe")
    disk_bytes = disk_room * file_bytes + file_bytes // 2  # not one more: headers differ by a few bytes
    cfg = offload(cpu_bytes_to_use=host_room * entry_bytes(), disk_path=str(tmp_path / "tier"),
                  disk_bytes_to_use=disk_bytes)  # fmt: skip
    llm = engine(cfg)
    connector = llm.engine.connector
    ps = [p[: TIER_BLOCK * (3 + i) + 8] for i, p in enumerate(prompts(4))]
    ref = generate(llm, ps, SHORT)
    connector.wait_for_stores(llm.engine.runner.kv_cache)
    assert dropped(counters(llm)) == {}
    assert connector.disk.evictions > 0 and len(connector.disk) == disk_room  # more than fit, and full
    found = []
    # Newest first: the oldest chains went first, and each replay stores what it computes again.
    for p, out in reversed(list(zip(ps, ref, strict=True))):
        disk = connector.disk._index
        assert all(e.parent is None or e.parent in disk for e in disk.values())  # nothing stranded
        llm.reset_prefix_cache()  # only the tiers remember
        expected = tier_reachable_tokens(llm, p)
        c0 = counters(llm)
        assert generate(llm, [p], SHORT) == [out]
        c1 = counters(llm)
        assert delta(c1, c0, HITS) == expected
        found.append((expected, (len(p) - 1) // BLOCK * BLOCK, delta(c1, c0, DISK_LOADS)))
        connector.wait_for_stores(llm.engine.runner.kv_cache)  # its disk writes land before the next lookup
    assert dropped(counters(llm)) == {}
    assert any(0 < hit < whole for hit, whole, _ in found)  # a chain whose tail went, its start kept
    assert any(hit and from_disk for hit, _, from_disk in found)  # and found on the disk


# -- dropped stores, counted by tier and reason ---------------------------------------------


def test_stores_into_a_host_tier_pinned_by_loads_are_dropped_as_no_space():
    """A's entries fill the host tier; A loading them pins every slot in the step that issues
    B's stores, so B's have nowhere to go."""
    a, b = prompts(2, seed=5)
    llm = engine(offload(cpu_bytes_to_use=len(a) // TIER_BLOCK * entry_bytes()))
    generate(llm, [a])
    llm.reset_prefix_cache()
    llm.add_request({"prompt_token_ids": b}, GREEDY)
    llm.step()  # B's prefill: its full entries are planned, to be issued in the next step
    llm.add_request({"prompt_token_ids": a}, GREEDY)
    llm.step()  # A's lookup pins every slot, then B's stores are issued
    assert dropped(counters(llm)) == {("host", "no_space"): len(b) // TIER_BLOCK}


@pytest.fixture(scope="module")
def one_entry_disk(tmp_path_factory):
    """A prompt of several entries into a disk tier with room for one: its first entry lands;
    its second could only land by evicting the first (it would be stranded); the rest follow
    an entry the disk does not hold."""
    disk = tmp_path_factory.mktemp("one-entry-disk")
    file_bytes = disk_file_bytes(disk / "probe")
    llm = engine(offload(disk_path=str(disk / "tier"), disk_bytes_to_use=file_bytes + file_bytes // 2))
    p = prompts(1)[0]
    generate(llm, [p])
    llm.engine.connector.wait_for_stores(llm.engine.runner.kv_cache)
    return llm, len(p) // TIER_BLOCK


def test_a_disk_entry_that_would_evict_its_own_parent_is_dropped_as_no_space(one_entry_disk):
    llm, _ = one_entry_disk
    assert dropped(counters(llm)).get(("disk", "no_space")) == 1
    assert len(llm.engine.connector.disk) == 1 and llm.engine.connector.disk.evictions == 0


def test_a_disk_entry_whose_parent_the_disk_lacks_is_dropped_as_parent_missing(one_entry_disk):
    llm, entries = one_entry_disk
    assert dropped(counters(llm)).get(("disk", "parent_missing")) == entries - 2
    assert counters(llm)[STORES] == entries * entry_bytes()  # the host tier took them all


def test_a_disk_tier_whose_directory_breaks_drops_its_stores_as_io_error(tmp_path):
    """Each chain's first write fails; the disk then holds no parent for the rest of it."""
    llm = engine(offload(disk_path=str(tmp_path), disk_bytes_to_use=1 << 26))
    disk_dir = llm.engine.connector.disk.dir
    # A file where the directory was: nothing can be created in it, even by root (whom a
    # chmod would not stop).
    shutil.rmtree(disk_dir)
    disk_dir.write_bytes(b"")
    ps = prompts(2)
    generate(llm, ps)
    llm.engine.connector.wait_for_stores(llm.engine.runner.kv_cache)
    entries = sum(len(p) // TIER_BLOCK for p in ps)
    assert dropped(counters(llm)) == {("disk", "io_error"): len(ps), ("disk", "parent_missing"): entries - len(ps)}
    assert counters(llm)[STORES] == entries * entry_bytes()  # still in host memory


def _planned_then(control) -> dict[tuple[str, str], float]:
    """Prefill one prompt (its full entries are planned, issued next step), then ``control``."""
    llm = engine(offload())
    p = prompts(1)[0]
    llm.add_request({"prompt_token_ids": p}, GREEDY)
    llm.step()
    assert len(llm.engine.connector._planned) == len(p) // TIER_BLOCK
    control(llm)
    assert counters(llm).get(STORES, 0) == 0
    return dropped(counters(llm))


def test_planned_stores_cancelled_by_a_tier_reset_are_dropped_as_cache_reset():
    got = _planned_then(lambda llm: llm.reset_prefix_cache(reset_connector=True))
    assert got == {("host", "cache_reset"): len(prompts(1)[0]) // TIER_BLOCK}


def test_planned_stores_of_replaced_weights_are_dropped_as_version_stale():
    def new_weights(llm: LLM) -> None:
        llm.update_weights(list(llm.engine.source.iter_weights(llm.engine.runner.dtype)))
        llm.finish_weight_update()

    got = _planned_then(new_weights)
    assert got == {("host", "version_stale"): len(prompts(1)[0]) // TIER_BLOCK}


def test_the_dropped_stores_help_names_every_reason():
    from siesta.metrics import SPECS

    assert all(reason.value in SPECS["kv_offload_dropped_stores"].help for reason in DropReason)


def test_closing_the_engine_finishes_its_stores_onto_the_disk(tmp_path):
    """The stores the last step planned would go with the process (no one left to count them):
    the engine core closes the engine before it exits, which lands them on the disk."""
    llm = engine(offload(disk_path=str(tmp_path), disk_bytes_to_use=1 << 26))
    disk = llm.engine.connector.disk
    p = prompts(1)[0]
    llm.add_request({"prompt_token_ids": p}, GREEDY)
    llm.step()  # the prefill: its entries are planned, not yet stored
    assert len(disk) == 0
    llm.engine.close()
    assert len(disk) == len(p) // TIER_BLOCK == len(list(disk.dir.glob("*.kv")))
    assert dropped(counters(llm)) == {}


def test_a_burst_replay_into_a_tier_too_small_for_it_loads_everything_the_tier_held():
    """The seed's replay when the tier holds only part of the burst's KV: each request loads
    what the tier kept of it and recomputes the rest, and those recomputed entries, stored,
    must not evict entries that requests still waiting are about to load (least recently used
    first, they would be exactly those, and the replay would thrash)."""
    ps = prompts(6, seed=11)
    entries = sum(len(p) // TIER_BLOCK for p in ps)
    llm = engine(offload(cpu_bytes_to_use=(entries * 2 // 3) * entry_bytes()), max_num_batched_tokens=64)
    generate(llm, ps, SHORT)
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    reachable = sum(tier_reachable_tokens(llm, p) for p in ps)
    assert 0 < reachable < sum((len(p) - 1) // BLOCK * BLOCK for p in ps)  # the tier holds part of it
    c0 = counters(llm)
    generate(llm, ps, SHORT)
    assert delta(counters(llm), c0, HITS) == reachable


def test_an_engine_starts_on_a_disk_tier_holding_files_of_wrong_types_and_counts_them(tmp_path):
    cfg = offload(disk_path=str(tmp_path), disk_bytes_to_use=1 << 26)
    first = engine(cfg)
    ps = prompts(1)
    ref = generate(first, ps)
    first.engine.close()
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    files = sorted(folder.glob("*.kv"))
    assert len(files) >= 2
    raw = files[0].read_bytes()
    n = int.from_bytes(raw[4:8], "little")
    body = b'{"key": "g", "data_bytes": "x"}'.ljust(n)  # valid JSON, wrong types
    files[0].write_bytes(raw[:8] + body + raw[8 + n :])
    second = engine(cfg)  # the server used to exit with code 3 here
    assert counters(second)['siesta_kv_offload_damaged_entries_total{tier="disk"}'] == 1
    assert not files[0].exists()
    assert generate(second, ps) == ref
