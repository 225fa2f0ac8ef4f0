"""SGLang's rendezvous: the engine side, built from TCPStore and PrefixStores, against a trainer
process that joins through torch's own helper exactly as slime does (``sglang_trainer``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from siesta.weight_transfer.sender import free_port
from siesta.weight_transfer.sglang_group import SglangGroupInfo, open_sglang_group, parse_sglang_group
from siesta.weight_transfer.wire import WeightTransferError

TRAINER = Path(__file__).parent / "sglang_trainer.py"
CPU = torch.device("cpu")
NUMEL = 16


def start_trainer(port: int, group_name: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(TRAINER), "--port", str(port), "--group-name", group_name, *extra],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "starting"
    return proc


def test_the_engine_joins_a_group_torch_built_for_sglang_under_its_name_only():
    port = free_port()
    trainer = start_trainer(port, "slime-pp_0", "--mode", "send", "--tensors", "3", "--numel", str(NUMEL))
    try:
        # Another name reaches the same store but none of the group's keys: refused, in bounded time.
        wrong = SglangGroupInfo("127.0.0.1", port, rank_offset=1, world_size=2, group_name="slime", backend="gloo")
        t0 = time.monotonic()
        with pytest.raises(WeightTransferError, match="could not join weight update group 'slime'"):
            open_sglang_group(wrong, 0, CPU, timeout_s=1.5)
        assert time.monotonic() - t0 < 10
        info = SglangGroupInfo("127.0.0.1", port, rank_offset=1, world_size=2, group_name="slime-pp_0", backend="gloo")
        group = open_sglang_group(info, 0, CPU, timeout_s=60)
        got = []
        for _ in range(3):
            t = torch.empty(NUMEL)
            group.broadcast(t)
            got.append(t)
        assert trainer.wait(60) == 0
    finally:
        trainer.kill()
    assert (group.rank, group.world_size) == (1, 2)
    for i, t in enumerate(got):
        assert torch.equal(t, torch.arange(NUMEL, dtype=torch.float32) + i)
    group.close()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "bogus": 1}, "['bogus']"),
        ({"master_address": "", "master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
        ({"master_address": "h", "master_port": 70000, "rank_offset": 1, "world_size": 2}, "master_port"),
        ({"master_address": "h", "master_port": 1, "rank_offset": 0, "world_size": 2}, "rank_offset"),
        ({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "mpi"}, "backend"),
        ({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": ""}, "group_name"),
    ],
)
def test_bad_init_bodies_are_refused_naming_the_field(body, needle):
    with pytest.raises(WeightTransferError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_sglang_group(body)


def test_the_defaults_are_sglangs_and_nccl_needs_cuda():
    info = parse_sglang_group({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2})
    assert (info.group_name, info.backend) == ("weight_update_group", "nccl")
    with pytest.raises(WeightTransferError, match="'nccl' needs CUDA"):
        open_sglang_group(info, 0, CPU, timeout_s=1)
    with pytest.raises(WeightTransferError, match="outside world_size 2"):
        open_sglang_group(SglangGroupInfo("h", 1, 2, 2, backend="gloo"), 0, CPU, timeout_s=1)
