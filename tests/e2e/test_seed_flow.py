"""The seed's experiment over HTTP, against a server with the OffloadingConnector.

warm -> /sleep?level=1 (with and without clear_connector_cache=false) -> /wake_up -> replay,
then /metrics deltas. Kept tier: the replay hits every full block before each prompt's last
token, loads exactly what the warm-up stored, and stores nothing new. Cleared tier: no hits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e.servers import OFFLOAD_CONFIG, SERVER_KV_CACHE_BYTES, start_server, stop_server
from siesta.bench.resume import EXTERNAL_HITS, LOAD_BYTES, STORE_BYTES, delta, expected_hits, metric_sum
from siesta.client import SiestaClient

SERVED_NAME = "dsv41"  # the seed client's model name
BLOCK = 16  # the connector's block_size in OFFLOAD_CONFIG
NUM_PROMPTS = 4
MAX_TOKENS = 4
# (L - 1) % BLOCK + MAX_TOKENS <= BLOCK - 1: the warm-up's generated tokens complete no
# further block, so what it stores is exactly the blocks a replay can hit.
PROMPT_BLOCKS = (6, 7, 8, 9)
PROMPT_EXTRA = 2
SEED_CLIENT = Path(__file__).with_name("seed_client.py")
SEED_CLIENT_TIMEOUT_S = 600


def _start_tier_server(*flags: str):
    return start_server(
        "--dev-mode", "--served-model-name", SERVED_NAME, "--kv-transfer-config", OFFLOAD_CONFIG,
        "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES), "--max-model-len", "2048", *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tier_server():
    server = _start_tier_server()
    yield server
    stop_server(server)


def _prompts(arm: int) -> list[list[int]]:
    first = 200 + arm * 5000  # each arm its own token ids: no shared prefixes
    return [
        [first + i * 400 + t for t in range(BLOCK * blocks + PROMPT_EXTRA)] for i, blocks in enumerate(PROMPT_BLOCKS)
    ]


def _burst(client: SiestaClient, prompts: list[list[int]]) -> list[str]:
    def one(prompt):
        out = client.completions(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return out["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _arm(server, keep: bool) -> dict:
    prompts = _prompts(int(keep))
    with server.client() as client:
        m0 = client.metrics()
        warm = _burst(client, prompts)
        client.sleep(level=1, clear_connector_cache=not keep)
        client.wake_up()
        m1 = client.metrics()
        replay = _burst(client, prompts)
        m2 = client.metrics()
    warm_delta, replay_delta = delta(m0, m1), delta(m1, m2)
    return {
        "warm_text": warm,
        "replay_text": replay,
        "expected_hits": expected_hits(prompts, BLOCK),
        "warm_stores": metric_sum(warm_delta, STORE_BYTES),
        "hits": metric_sum(replay_delta, EXTERNAL_HITS),
        "loads": metric_sum(replay_delta, LOAD_BYTES),
        "stores": metric_sum(replay_delta, STORE_BYTES),
    }


@pytest.fixture(scope="module")
def arms(tier_server):
    # The seed's order: the cleared arm first, then the kept one.
    return {"cleared": _arm(tier_server, keep=False), "kept": _arm(tier_server, keep=True)}


@pytest.fixture(scope="module")
def async_arms():
    server = _start_tier_server("--async-scheduling")
    try:
        yield {"cleared": _arm(server, keep=False), "kept": _arm(server, keep=True)}
    finally:
        stop_server(server)


@pytest.fixture(params=["sync", "async"])
def both_arms(request, arms, async_arms):
    return arms if request.param == "sync" else async_arms


def test_cleared_tier_gives_no_hits(both_arms):
    cleared = both_arms["cleared"]
    assert cleared["warm_stores"] > 0, cleared
    assert cleared["hits"] == 0 and cleared["loads"] == 0, cleared
    assert cleared["stores"] == cleared["warm_stores"], cleared  # everything recomputed, stored again


def test_kept_tier_is_loaded_not_recomputed(both_arms):
    kept = both_arms["kept"]
    assert kept["warm_stores"] > 0, kept
    assert kept["hits"] == kept["expected_hits"], kept  # every full block before each last token
    assert kept["loads"] == kept["warm_stores"], kept  # exactly what the warm-up stored
    assert kept["stores"] == 0, kept  # nothing recomputed
    assert kept["replay_text"] == kept["warm_text"]  # loaded KV, same greedy tokens


def test_seed_client_script_sees_the_tier_reused(tier_server, tmp_path):
    out = tmp_path / "seed.json"
    cmd = [sys.executable, str(SEED_CLIENT), "--port", str(tier_server.port), "--requests", "4",
           "--prompt-tokens", "64", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=SEED_CLIENT_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result) == {"cleared", "kept", "verdict"}
    assert json.loads(proc.stdout) == result
    assert result["verdict"] == "tier reused on resume", result


def test_bench_resume_over_http(tier_server, tmp_path):
    from siesta.entrypoints.cli import main

    out = tmp_path / "resume.json"
    main(["bench", "resume", "--url", tier_server.url, "--requests", "2", "--prompt-tokens", "98",
          "--max-tokens", "2", "--block-size", str(BLOCK), "--json", str(out), "--model", SERVED_NAME])  # fmt: skip
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    kept = result["arms"]["kept"]["summary"]
    assert kept["external_hits"] == kept["expected_hits"] > 0
    assert result["arms"]["cleared"]["summary"]["external_hits"] == 0
    assert result["verdict"] == "tier reused on resume"
    # The floor: each request's share of the replay's counted load bytes, in order, at link speed.
    floor = result["kept_floor"]
    assert sum(floor["kv_bytes"]) == kept["replay_load_bytes"] > 0
    assert floor["floor_s"] == sorted(floor["floor_s"]) and floor["decode_step_s"] >= 0
    assert floor["p50_over_floor"] == kept["replay_p50_s"] / floor["floor_p50_s"]
