"""A real engine-core process (tiny random model) driven through the asyncio client."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from siesta.config import CacheConfig, EngineConfig, ModelConfig
from siesta.control import EngineStateError, RequestRejected
from siesta.core.engine_core import EngineCore
from siesta.ipc.client import EngineCoreClient
from siesta.ipc.remote_errors import EngineDeadError
from siesta.request import EngineCoreRequest
from siesta.sampling import SamplingParams

MODEL = "random:tiny-llama"
KV_BYTES = 16 * 2**20
CALL_TIMEOUT_S = 120


def _config() -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=MODEL), cache=CacheConfig(kv_cache_bytes=KV_BYTES))


class LoopThread:
    """An event loop in a thread: the client lives there, tests call into it synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="module")
def core(loop):
    client = loop.run(EngineCoreClient.start(_config()))
    yield client
    loop.run(client.shutdown())


async def _generate(
    core: EngineCoreClient, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str]:
    stream = core.open_stream([rid])
    try:
        await core.add_request(EngineCoreRequest(rid, prompt, params))
        tokens: list[int] = []
        while True:
            for out in await stream.get():
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return tokens, out.finish_reason
    finally:
        core.close_stream([rid])


def test_ready_info(core):
    assert core.info.model_name.startswith(MODEL)
    assert core.info.vocab_size == 1024 and core.info.pid != os.getpid()


def test_greedy_tokens_match_the_in_process_engine(loop, core):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, reason = loop.run(_generate(core, "g1", [1, 2, 3, 4, 5], params))
    engine = EngineCore(_config())
    engine.add_request(EngineCoreRequest("g1", [1, 2, 3, 4, 5], params))
    want: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            want.extend(out.new_token_ids)
    assert tokens == want and reason == "length"


def test_concurrent_requests_are_routed_to_their_streams(loop, core):
    async def many():
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        return await asyncio.gather(*(_generate(core, f"c{i}", [10 + i, 20, 30], params) for i in range(6)))

    results = loop.run(many())
    assert all(len(tokens) == 5 and reason == "length" for tokens, reason in results)


def test_rejections_and_state_errors_keep_their_types(loop, core):
    with pytest.raises(RequestRejected, match="empty"):
        loop.run(core.add_request(EngineCoreRequest("e1", [], SamplingParams())))
    with pytest.raises(RequestRejected, match="vocabulary"):
        loop.run(core.add_request(EngineCoreRequest("e2", [5000], SamplingParams())))
    loop.run(core.sleep(level=1))
    with pytest.raises(EngineStateError):
        loop.run(core.resume())
    loop.run(core.wake_up())
    with pytest.raises(ValueError, match="mode"):
        loop.run(core.pause(mode="never"))
    assert loop.run(core.is_paused()) is False


def test_pause_wait_replies_after_the_request_finished(loop, core):
    async def scenario():
        rid = "w1"
        stream = core.open_stream([rid])
        await core.add_request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
        await stream.get()  # running
        await core.pause(mode="wait")
        outputs = []
        while True:  # everything is already queued: nothing here waits on the engine
            outputs.extend(await asyncio.wait_for(stream.get(), 0.1))
            if outputs[-1].finished:
                break
        core.close_stream([rid])
        paused = await core.is_paused()
        await core.resume()
        return outputs[-1].finish_reason, paused

    assert loop.run(scenario()) == ("length", True)


def test_abort_frees_the_request(loop, core):
    async def scenario():
        rid = "a1"
        stream = core.open_stream([rid])
        await core.add_request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True)))
        await stream.get()
        core.abort_nowait([rid])
        while True:
            for out in await stream.get():
                if out.finished:
                    return out.finish_reason

    assert loop.run(scenario()) == "abort"


def test_a_dead_core_fails_everything_clearly(loop):
    core = loop.run(EngineCoreClient.start(_config()))
    deaths: list[str] = []
    core.on_death = deaths.append

    async def scenario():
        stream = core.open_stream(["d1"])
        await core.add_request(EngineCoreRequest("d1", [1, 2], SamplingParams(max_tokens=100000, ignore_eos=True)))
        await stream.get()
        assert core.metrics.as_dict()["siesta_num_requests_running"] == 1
        os.kill(core.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code"):
            while True:
                await stream.get()
        assert not core.is_alive and "exit code -9" in core.dead_reason
        assert deaths == [core.dead_reason]  # the server is told, once, and exits
        gauges = core.metrics.as_dict()  # no stale figures of a dead engine
        assert gauges["siesta_engine_alive"] == 0 and gauges["siesta_num_requests_running"] == 0
        with pytest.raises(EngineDeadError):
            await core.is_paused()
        with pytest.raises(EngineDeadError):
            core.open_stream(["d2"])

    try:
        loop.run(scenario())
    finally:
        loop.run(core.shutdown())


def test_startup_failure_is_reported(loop):
    bad = EngineConfig(model=ModelConfig(model="random:no-such-shape"))
    with pytest.raises(ValueError, match="no-such-shape"):
        loop.run(EngineCoreClient.start(bad))


def test_the_clients_pause_and_sleep_clear_the_tier_by_default(loop):
    """clear_connector_cache defaults to true on the client's own methods too: a replay after
    a default pause or sleep loads nothing, while keeping the tier (asked for) loads."""
    from siesta.config import KVTransferConfig

    tier = KVTransferConfig(kv_connector="OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24})
    core = loop.run(EngineCoreClient.start(EngineConfig(model=ModelConfig(model=MODEL), kv_transfer=tier,
                                                       cache=CacheConfig(kv_cache_bytes=KV_BYTES))))  # fmt: skip
    hits = "siesta_external_prefix_cache_hits_total"
    prompt, params = list(range(1, 70)), SamplingParams(max_tokens=2, temperature=0)

    async def replay_hits(n: int, control) -> float:
        await _generate(core, f"warm{n}", prompt, params)
        await control()
        before = core.metrics.as_dict()[hits]
        await _generate(core, f"replay{n}", prompt, params)
        return core.metrics.as_dict()[hits] - before

    async def scenario():
        async def keep():
            await core.pause(mode="keep", clear_connector_cache=False)
            await core.resume()

        async def default_pause():
            await core.pause(mode="keep")
            await core.resume()

        async def default_sleep():
            await core.sleep(level=1)
            await core.wake_up()

        assert await replay_hits(0, keep) > 0  # the control: a kept tier does load
        assert await replay_hits(1, default_pause) == 0
        assert await replay_hits(2, default_sleep) == 0

    try:
        loop.run(scenario())
    finally:
        loop.run(core.shutdown())


def test_state_queries_answer_from_the_cores_last_message_and_track_every_change(loop, core):
    # is_paused, is_sleeping and the weight version never wait behind the step in flight: each
    # message of the core carries them. The oracle is the core's own answer to the call.
    import msgspec

    from siesta.ipc.protocol import EngineInfo, GetInfo, IsPaused, IsSleeping

    async def direct():
        info = msgspec.convert(await core.call(GetInfo()), EngineInfo)
        return await core.call(IsPaused()), await core.call(IsSleeping()), info.weight_version

    async def cached():
        return await core.is_paused(), await core.is_sleeping(), (await core.get_info()).weight_version

    async def scenario():
        seen = []
        for change in (lambda: core.pause(mode="keep"), core.resume, lambda: core.sleep(level=1), core.wake_up,
                       lambda: core.update_weight_version("renamed", False), lambda: core.update_weight_version("0", False)):  # fmt: skip
            await change()
            got, want = await cached(), await direct()
            seen.append(got)
            assert got == want, (got, want)
        return seen

    seen = loop.run(scenario())
    assert [s[:2] for s in seen[:4]] == [(True, False), (False, False), (True, True), (False, False)]
    assert seen[4][2] == "renamed" and seen[5][2] == "0"
    calls_before = core._ids  # a cached query sends nothing to the core
    n = next(calls_before)
    loop.run(core.is_paused())
    assert next(core._ids) == n + 1
