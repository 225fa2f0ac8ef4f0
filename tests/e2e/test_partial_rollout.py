"""A partial rollout (slime, AReaL, verl): a sample aborted mid-generation is sent again as
prompt + what it generated, and hits the cache for its generated blocks too."""

from __future__ import annotations

import json

import httpx

from e2e.servers import wait_for

BLOCK = 16


def test_a_resent_partial_rollout_hits_its_generated_blocks(dev_server):
    prompt = [100 + i for i in range(40)]
    body = {"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True, "return_token_ids": True}
    generated: list[int] = []
    with httpx.stream("POST", f"{dev_server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                generated += json.loads(line[len("data: ") :])["choices"][0]["token_ids"]
                if len(generated) >= 40:
                    break  # the rollout is cut off here: the client goes away
    wait_for(lambda: dev_server.metrics()["siesta_num_requests_running"] == 0, what="the abort")
    resent = prompt + generated
    r = httpx.post(f"{dev_server.url}/v1/completions", json={"prompt": resent, "max_tokens": 1}, timeout=60)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(resent) - 1) // BLOCK * BLOCK  # every full block, generated ones too
    assert cached > len(prompt)


def test_after_a_kept_tier_sleep_the_generated_blocks_load_from_the_tier():
    from e2e.servers import OFFLOAD_CONFIG, SERVER_KV_CACHE_BYTES, start_server, stop_server

    server = start_server("random:tiny-llama", "--dev-mode", "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES),
                          "--kv-transfer-config", OFFLOAD_CONFIG)  # fmt: skip
    try:
        prompt = [7 + i for i in range(40)]
        out = httpx.post(f"{server.url}/v1/completions", timeout=60,
                         json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "return_token_ids": True})  # fmt: skip
        generated = out.json()["choices"][0]["token_ids"]
        with server.client() as client:
            client.sleep(level=1, clear_connector_cache=False)  # the device cache goes, the tier stays
            client.wake_up()
            hits = client.metrics()["siesta_external_prefix_cache_hits_total"]
            resent = prompt + generated
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": resent, "max_tokens": 1}, timeout=60)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(resent) - 1) // BLOCK * BLOCK
            assert (
                client.metrics()["siesta_external_prefix_cache_hits_total"] - hits == (len(resent) - 1) // BLOCK * BLOCK
            )
    finally:
        stop_server(server)
