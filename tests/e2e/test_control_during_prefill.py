"""Control calls that arrive while a long prompt prefills, chunk by chunk, over many steps:
each is answered after at most the step in flight plus its own work, never after the rest
of the prefill (the engine-core loop takes calls between steps). The sleep, the pause and
the abort land mid-step; the wake-up and the resume find the engine stopped, and are held
to the same bound.

No wall-clock threshold is fixed here: the step time comes from the server's own
``siesta_engine_step_seconds`` histogram, a call's own work from the same call made while
the engine is idle, and the check allows a generous factor over their sum (see
``SLACK_FACTOR``). Independently of any timing, each call must return before the request's
first token: a call that waited for the prefill to finish could not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from e2e.servers import DEV_MAX_MODEL_LEN, StreamReader, start_server, stop_server, wait_for
from siesta.client import SiestaClient

# One prefill chunk per step, and a prompt of many chunks: its prefill takes PROMPT_TOKENS /
# CHUNK_TOKENS steps (40), each a forward of CHUNK_TOKENS tokens of the embedded model on one
# thread; the calls below end it (abort) long before its last one.
CHUNK_TOKENS = 16
PROMPT_TOKENS = 640
FIRST_PROMPT_TOKEN = 1000  # token ids well inside the vocabulary
KV_CACHE_BYTES = 64 * 2**20  # a few prompts of this length
REQUEST_ID = "e2e-long-prefill"
# A call is answered within (the step in flight + its own work); allowed: this many times
# that. The step is bounded by the edge of the histogram bucket holding the slowest step
# (within 1.5x of it), the work by the slowest idle run. The factor absorbs what the two
# cores, shared with other test workers, add on top: the API server or the engine core
# descheduled for a while. A call that waited for more than a few steps is over it; one that
# waited for the rest of the prefill (dozens of steps) is also caught by the first-token
# check, whatever the factor.
SLACK_FACTOR = 3.0
IDLE_RUNS = 2  # each call's own work: the slowest of this many idle runs
STEPS_BEFORE_A_CALL = 2  # the prefill steps on between the calls that land while it runs
STEP = "siesta_engine_step_seconds"


@dataclass
class ControlCall:
    name: str
    call: Callable[[SiestaClient], object]


CALLS = [
    ControlCall("sleep", lambda c: c.sleep(level=1, mode="keep")),
    ControlCall("wake_up", lambda c: c.wake_up()),
    ControlCall("pause", lambda c: c.pause(mode="keep")),
    ControlCall("resume", lambda c: c.resume()),
]
ABORT = ControlCall("abort_requests", lambda c: c.abort_requests([REQUEST_ID]))


@pytest.fixture(scope="module")
def server():
    s = start_server("--dev-mode", "--max-model-len", str(DEV_MAX_MODEL_LEN), "--kv-cache-bytes", str(KV_CACHE_BYTES),
                     "--max-num-batched-tokens", str(CHUNK_TOKENS))  # fmt: skip
    yield s
    stop_server(s)


def timed(client: SiestaClient, control: ControlCall) -> float:
    t0 = time.perf_counter()
    control.call(client)
    return time.perf_counter() - t0


def own_work(client: SiestaClient) -> dict[str, float]:
    """Each call's latency while nothing runs: the HTTP round trip and the call's own work."""
    slowest: dict[str, float] = {}
    for _ in range(IDLE_RUNS):
        for control in [*CALLS, ABORT]:
            slowest[control.name] = max(slowest.get(control.name, 0.0), timed(client, control))
    return slowest


def step_count(metrics: dict[str, float]) -> float:
    return metrics.get(f"{STEP}_count", 0.0)


def slowest_step_bound(before: dict[str, float], after: dict[str, float]) -> float:
    """The upper edge of the histogram bucket that holds the slowest step run between the
    two scrapes: a bound on any one step's time, from the server's own count."""
    steps = step_count(after) - step_count(before)
    prefix = f'{STEP}_bucket{{le="'
    edges = sorted((float(key[len(prefix) : -2]), key) for key in after if key.startswith(prefix))
    for edge, key in edges:
        if after[key] - before.get(key, 0.0) == steps:
            return edge
    raise AssertionError("the step histogram lost count")


def wait_for_steps(server, n: int) -> None:
    """Until the engine has run ``n`` more steps: the prefill is under way again."""
    start = step_count(server.metrics())
    wait_for(lambda: step_count(server.metrics()) >= start + n, what=f"{n} more steps")


def test_control_calls_mid_prefill_wait_at_most_for_the_step_in_flight(server):
    with server.client() as client:
        idle = own_work(client)
        before = server.metrics()
        prompt = list(range(FIRST_PROMPT_TOKEN, FIRST_PROMPT_TOKEN + PROMPT_TOKENS))
        reader = StreamReader(server, {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0.0},
                              headers={"X-Request-Id": REQUEST_ID})  # fmt: skip
        reader.start()
        wait_for(lambda: server.metrics()["siesta_num_requests_running"] == 1, what="the prefill to start")
        latency: dict[str, float] = {}
        for control in CALLS:
            if control.name in ("sleep", "pause"):
                wait_for_steps(server, STEPS_BEFORE_A_CALL)  # so the call lands mid-step
            latency[control.name] = timed(client, control)
            assert reader.chunks == [], f"{control.name} was answered only after the prefill"
        wait_for_steps(server, STEPS_BEFORE_A_CALL)
        latency[ABORT.name] = timed(client, ABORT)
        reader.finish()
        assert reader.finish_reason == "abort" and reader.text == ""  # aborted mid-prefill
        step_bound = slowest_step_bound(before, server.metrics())
    assert math.isfinite(step_bound)
    for name, took in latency.items():
        allowed = SLACK_FACTOR * (step_bound + idle[name])
        assert took <= allowed, f"{name} took {took:.3f}s; one step ({step_bound}s) + its work ({idle[name]:.3f}s)"
