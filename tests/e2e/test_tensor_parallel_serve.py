"""``siesta serve --tensor-parallel-size 3`` (the embedded model's 9 heads split over 3 ranks):
the seed's flow over HTTP, tier kept and cleared, against the single-device engine's text; and
a rank killed under a running server takes the server down with a clear error, not a hang.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from e2e.servers import stop_server
from e2e.test_seed_flow import MAX_TOKENS, _arm, _prompts, _start_tier_server
from siesta import SamplingParams

TP = 3
# A dead rank ends the engine core, and the server exits with code 3 (a supervisor restarts it).
EXIT_DEAD_ENGINE = 3
DEATH_BOUND_S = 30.0


def _tp_server():
    return _start_tier_server("--tensor-parallel-size", str(TP))


@pytest.fixture(scope="module")
def tp_server():
    server = _tp_server()
    yield server
    stop_server(server)


def _offline_text(offline_llm, prompts: list[list[int]]) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in offline_llm.generate(prompts, params, use_tqdm=False)]


def test_the_seed_flow_at_tensor_parallel_3(tp_server, offline_llm):
    with tp_server.client() as client:
        assert client.get_world_size() == TP
    cleared, kept = _arm(tp_server, keep=False), _arm(tp_server, keep=True)
    assert cleared["hits"] == 0 and cleared["stores"] == cleared["warm_stores"] > 0, cleared
    assert kept["hits"] == kept["expected_hits"] > 0, kept  # a hit on every rank, or none
    assert kept["loads"] == kept["warm_stores"] and kept["stores"] == 0, kept
    # Every rank's shard came back from the tier: the text is the single-device engine's.
    for arm, keep in ((cleared, False), (kept, True)):
        want = _offline_text(offline_llm, _prompts(int(keep)))
        assert arm["warm_text"] == want and arm["replay_text"] == want


# Last in the module, as pytest runs it: it ends the module's server (a fresh one at tensor
# parallel 3 costs the suite its slowest start).
def test_a_killed_rank_takes_the_server_down_with_its_name(tp_server):
    ranks = _rank_pids(tp_server.process.pid)
    assert len(ranks) == TP - 1, ranks
    os.kill(ranks[0], signal.SIGKILL)
    t0 = time.monotonic()
    code = tp_server.process.wait(DEATH_BOUND_S)
    assert code == EXIT_DEAD_ENGINE, tp_server.log()
    assert time.monotonic() - t0 < DEATH_BOUND_S
    assert "tensor-parallel rank" in tp_server.log() and "killed by SIGKILL" in tp_server.log()
    time.sleep(1.0)
    assert not [p for p in ranks[1:] if _alive(p)], "the other ranks outlived the engine"


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _rank_pids(server_pid: int) -> list[int]:
    """The rank processes: children of the engine core, itself a child of the server."""
    ranks = []
    for core in _children(server_pid):
        for child in _children(core):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"multiprocessing" in f.read():
                    ranks.append(child)
    return sorted(ranks)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
