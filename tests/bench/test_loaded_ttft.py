"""``siesta.bench.loaded_ttft``: one arm end to end on loopback (a real ``siesta serve`` of the
embedded model, one spinning process beside it), and the JSON it writes."""

from __future__ import annotations

import argparse
import json

from siesta.bench import loaded_ttft


def test_one_arm_streams_and_times_its_answers() -> None:
    args = argparse.Namespace(requests=2, load_procs=1, kv_cache_bytes="64M")
    arm = loaded_ttft.run_arm(1, args)
    json.dumps(arm)
    assert arm["cpu_threads"] == 1 and len(arm["ttft_s"]) == 2
    # The first token comes before the last: a stream, not one reply.
    assert 0 < arm["ttft_p50_s"] <= arm["latency_p50_s"] and arm["ttft_max_s"] <= arm["latency_max_s"]
