"""Three replicas behind the real gateway (smg from PyPI), driven as one fleet.

The tests run in order on one fleet: generation spreads over it; a fleet sleep(keep)/wake
resumes the requests in flight, each from its own replica's tier; resumed requests are routed
to the replica whose tier holds them (against round-robin); a trainer's push over gloo reaches
every replica at once and each serves the trainer's logprobs; and, last, a replica killed in
the middle of a push gives a partial-failure answer, the fleet stays paused and serves no
mixed versions, and once the dead replica is dropped a new push brings the rest back.
Everything is checked against what the replicas' own /metrics and a transformers trainer say.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleet.fleets import BLOCK, SERVE_ARGS, gateway_config, replica_env, requires_smg
from siesta.bench.fleet_routing import generate, replica_metrics, run_arm
from siesta.bench.resume import EXTERNAL_HITS, make_prompts, metric_sum
from siesta.client import SiestaClient
from siesta.fleet import FleetError
from siesta.fleet.fleet import Fleet, FleetSpec
from siesta.model.random_init import RANDOM_SHAPES
from siesta.weight_transfer import WeightSender

pytestmark = [requires_smg, pytest.mark.timeout(300)]

REPLICAS = 3
NAME = "test"
HTTP_TIMEOUT_S = 60.0
PROMPT = [3, 17, 42, 7, 99, 5, 250, 11, 64, 8, 1, 300, 77, 21, 9, 4]
STEPS = 5
TOLERANCE = 1e-4
PROMPT_TOKENS = "siesta_prompt_tokens_total"
SUCCESS = "siesta_request_success_total"


@pytest.fixture(scope="module")
def fleet():
    spec = FleetSpec(replicas=REPLICAS, name=NAME, serve_args=SERVE_ARGS, gateway=gateway_config())
    fleet = Fleet.start(spec, env=replica_env())
    try:
        yield fleet
    except BaseException:
        for r in fleet.replicas:
            print(f"--- replica {r.spec.index}\n{r.log()}")
        raise
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def client(fleet):
    with fleet.client() as client:
        yield client


def trainer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(RANDOM_SHAPES["tiny-llama"].config()).float().eval()


def assert_serves(url: str, hf: torch.nn.Module) -> None:
    """The replica's greedy tokens and their logprobs are the trainer's (fp32, to 1e-4)."""
    with SiestaClient(url, timeout=HTTP_TIMEOUT_S) as c:
        choice = c.completions(PROMPT, max_tokens=STEPS, temperature=0, logprobs=0, ignore_eos=True)["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT + tokens])).logits[0].float(), -1)
    assert tokens[0] == int(logp[len(PROMPT) - 1].argmax())
    want = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], want)) <= TOLERANCE


class Stream(threading.Thread):
    """One streamed /generate through the gateway, counting the tokens as they come."""

    def __init__(self, url: str, input_ids: list[int], rid: str, max_new_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.input_ids, self.rid, self.max_new_tokens = url, input_ids, rid, max_new_tokens
        self.output_ids: list[int] = []
        self.meta: dict = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        body = {"input_ids": self.input_ids, "rid": self.rid, "stream": True, "sampling_params": params}
        try:
            with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=HTTP_TIMEOUT_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data:") and line.strip() != "data: [DONE]":
                        chunk = json.loads(line[len("data:"):])
                        assert "error" not in chunk, chunk
                        self.output_ids, self.meta = chunk["output_ids"], chunk["meta_info"]
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def finish(self) -> None:
        self.join(HTTP_TIMEOUT_S)
        assert not self.is_alive() and self.error is None, self.error


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def deltas(after: list[dict[str, float]], before: list[dict[str, float]], name: str) -> list[int]:
    return [int(metric_sum(a, name) - metric_sum(b, name)) for a, b in zip(after, before)]


def received(urls: list[str]) -> list[int]:
    """Requests each replica's API server holds unfinished (SGLang's load report)."""
    return [httpx.get(f"{u}/v1/loads", timeout=HTTP_TIMEOUT_S).json()["aggregate"]["total_reqs"] for u in urls]


def test_generation_spreads_across_the_replicas_and_the_gateway_knows_each(fleet, client):
    urls = [r.url for r in fleet.replicas]
    before = replica_metrics(urls)
    prompts = make_prompts(12, 40, seed=1)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda i: generate(fleet.url, prompts[i], f"spread-{i}", 4), range(len(prompts))))
    assert all(len(o["output_ids"]) == 4 and o["meta_info"]["weight_version"] == "0" for o in outs)
    served = deltas(replica_metrics(urls), before, SUCCESS)
    assert sum(served) == len(prompts) and all(n >= 1 for n in served), served
    # What the gateway took from each replica: its weight version (SGLang's /get_server_info
    # at registration) and its load (/v1/loads, polled).
    replicas = client.replicas()
    assert [r.index for r in replicas] == list(range(REPLICAS))
    assert all(r.weight_version == "0" and r.health == "ready" for r in replicas)
    def loads_polled() -> bool:
        workers = fleet.gateway.http.get("/workers").json()["workers"]
        return len(workers) == REPLICAS and all(
            w.get("engine_load", {}).get("loads", [{}])[0].get("max_total_num_tokens", 0) > 0 for w in workers
        )

    wait_for(loads_polled, what="the gateway's first load poll of every replica")


def test_a_fleet_sleep_keep_resumes_requests_in_flight_from_each_replicas_own_tier(fleet, client):
    urls = [r.url for r in fleet.replicas]
    prompt_len, max_new = 6 * BLOCK + 3, 900  # long: a tiny model decodes a token in about a ms
    prompts = make_prompts(6, prompt_len, seed=2)
    before = replica_metrics(urls)
    streams = [Stream(fleet.url, p, f"inflight-{i}", max_new) for i, p in enumerate(prompts)]
    # Held at the door until all have arrived, so that all decode at once when the sleep comes.
    client.pause(mode="keep")
    for s in streams:
        s.start()
    wait_for(lambda: sum(received(urls)) == len(streams), what="every request at its replica")
    client.resume()
    wait_for(lambda: all(s.output_ids for s in streams), what="every stream to be decoding", poll_s=0.002)
    at_sleep = [len(s.output_ids) for s in streams]
    client.sleep(level=1, mode="keep", clear_connector_cache=False)  # device KV released, tiers kept
    assert all(client.is_sleeping().values())
    slept = replica_metrics(urls)
    client.wake_up()
    for s in streams:
        s.finish()
    after = replica_metrics(urls)
    assert all(len(s.output_ids) == max_new for s in streams)
    assert all(n < max_new for n in at_sleep), at_sleep  # they were cut off, then resumed
    # Where each request ran, from the replicas' own counters: prompt tokens at admission.
    ran = [n // prompt_len for n in deltas(slept, before, PROMPT_TOKENS)]
    hits = deltas(after, slept, EXTERNAL_HITS)
    assert sum(ran) == len(prompts), ran
    for r in range(REPLICAS):
        # Every request resumed on the replica it ran on, loading at least its prompt's full
        # blocks from that replica's tier; a replica that ran none loaded nothing.
        least = ran[r] * (prompt_len // BLOCK * BLOCK)
        assert (hits[r] >= least) if ran[r] else hits[r] == 0, (r, ran, hits)
    # The resumed outputs are what the same requests compute afresh (greedy, same weights).
    client.reset_prefix_cache(reset_external=True)
    for s in streams[:2]:
        fresh = generate(fleet.url, s.input_ids, f"{s.rid}-fresh", max_new)
        assert fresh["output_ids"] == s.output_ids


def test_resumed_requests_go_to_the_replica_whose_tier_holds_them(fleet):
    # The bench's experiment, smaller: each arm a gateway of its own over the same replicas.
    aware = run_arm("cache_aware", fleet.replicas, 12, 5 * BLOCK + 7, 8, seed=3)
    rr = run_arm("round_robin", fleet.replicas, 12, 5 * BLOCK + 7, 8, seed=4)
    assert aware.hit_fraction_of_possible == 1.0, aware
    assert sum(1 for n in aware.per_replica_warm_tokens if n) >= 2, aware  # and it still spreads the load
    assert rr.hit_fraction_of_possible < 0.7, rr  # about 1/3: a resumed request lands anywhere


def test_a_push_over_gloo_reaches_every_replica_and_holds_new_requests_until_it_is_whole(fleet, client):
    old = client.weight_version()
    sender = WeightSender(client, "nccl", bucket_bytes=64 << 10)
    sender.init()  # one group: the trainer at rank 0, replica i at 1 + i
    assert client.rank_offsets() == {i: 1 + i for i in range(REPLICAS)}
    try:
        hf = trainer(1)
        client.start_weight_update()  # the fleet pauses first: nothing is admitted mid-update
        held = Stream(fleet.url, PROMPT, "held", STEPS)
        held.start()
        time.sleep(0.5)
        assert held.output_ids == [] and held.is_alive()
        sender.send(hf)
        version = client.finish_weight_update()  # publish everywhere, read back, relabel, resume
        held.finish()
        assert version == str(int(old) + 1)
        # The request sent during the update ran on the new weights only.
        assert held.meta["weight_versions"] == [{"weight_version": version, "start": 0, "end": STEPS}]
        assert client.weight_versions() == {i: version for i in range(REPLICAS)}
        assert [r.weight_version for r in client.replicas()] == [version] * REPLICAS  # the gateway's registry
        for r in fleet.replicas:
            assert_serves(r.url, hf)
        # The same as one transaction: pause, send, publish, check, resume.
        hf2 = trainer(2)
        version2 = client.push(sender, hf2)
        assert client.weight_versions() == {i: version2 for i in range(REPLICAS)}
        assert not any(client.is_paused().values())
        for r in fleet.replicas:
            assert_serves(r.url, hf2)
    finally:
        sender.close()


def test_a_replica_killed_mid_push_fails_the_push_cleanly_and_no_mixed_versions_are_served(fleet, client):
    old = client.weight_version()
    victim = fleet.replica(REPLICAS - 1)
    sender = WeightSender(client, "nccl", bucket_bytes=32 << 10)  # several buckets: one goes, then the kill
    sender.init()
    broadcast = sender.group.broadcast
    sent = []

    def broadcast_then_kill(tensor):
        broadcast(tensor)
        sent.append(tensor.numel())
        if len(sent) == 1:
            victim.kill()

    sender.group.broadcast = broadcast_then_kill
    try:
        with pytest.raises(FleetError) as failure:
            client.push(sender, trainer(3))
    finally:
        sender.close()
    result = failure.value.result
    assert "stays paused" in str(failure.value)
    assert [r.index for r in result.replicas] == list(range(REPLICAS))
    assert not any(r.ok for r in result.replicas)  # the survivors took one bucket of several: torn
    assert "unreachable" in result.replicas[-1].detail or "upstream" in result.replicas[-1].detail
    # Nothing was published: the survivors still report the old version, and stay paused.
    for r in fleet.replicas[:-1]:
        with SiestaClient(r.url, timeout=HTTP_TIMEOUT_S) as c:
            assert c.weight_version() == old and c.is_paused()
    with pytest.raises(FleetError, match="may serve other weights"):
        client.resume()
    # Drop the dead replica, push again to the rest (a new group of two), and they serve it.
    client.drop(victim.spec.index)
    assert [r.index for r in client.replicas()] == list(range(REPLICAS - 1))
    sender = WeightSender(client, "nccl", bucket_bytes=64 << 10)
    sender.init()
    try:
        hf = trainer(4)
        version = client.push(sender, hf)
    finally:
        sender.close()
    assert version == str(int(old) + 1)
    prompts = make_prompts(6, 30, seed=5)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda i: generate(fleet.url, prompts[i], f"after-{i}", 3), range(len(prompts))))
    assert {o["meta_info"]["weight_version"] for o in outs} == {version}
    for r in fleet.replicas[:-1]:
        assert_serves(r.url, hf)
