"""The tensor-parallel slice bench: what each rank keeps adds up to the full tensors, counted
by hand (norms are kept whole by every rank)."""

import torch

from siesta.bench.tp_weights import measure


def test_each_ranks_kept_bytes_add_up_to_the_full_layers():
    # tiny-llama: 2 layers of hidden 64, 4 heads of 16, 2 KV heads, 128 MLP features; fp32.
    result = measure("tiny-llama", layers=2, tp_size=2, device=torch.device("cpu"), dtype=torch.float32, reps=1)
    per_layer = {"qkv": (64 + 2 * 32) * 64, "o": 64 * 64, "gate_up_down": 3 * 128 * 64, "norms": 2 * 64}
    full = 2 * sum(per_layer.values()) * 4
    assert result["full_bytes"] == full
    single, *ranks = result["ranks"]
    assert (single["tp_size"], single["bytes_kept"]) == (1, full)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sum(r["bytes_kept"] for r in ranks) == full + 2 * per_layer["norms"] * 4  # norms twice
    assert all(r["slice_full_s"] > 0 and r["copy_shard_s"] > 0 for r in result["ranks"])
