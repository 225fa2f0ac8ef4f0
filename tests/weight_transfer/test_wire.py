"""The update_info format: every malformed declaration is refused by name, before any byte moves."""

from __future__ import annotations

import pytest
import torch

from siesta.config import WeightTransferConfig
from siesta.weight_transfer.wire import (
    WeightTransferError,
    bucket_bounds,
    parse_nccl_init,
    parse_update_info,
)

DEFAULTS = WeightTransferConfig()


def info(**over):
    base = {"names": ["a", "b"], "dtype_names": ["float32", "bfloat16"], "shapes": [[2, 3], [4]]}
    return base | over


def test_a_declaration_parses_with_vllms_defaults_and_byte_counts():
    parsed = parse_update_info(info(), DEFAULTS)
    assert [t.name for t in parsed.tensors] == ["a", "b"]
    assert [t.dtype for t in parsed.tensors] == [torch.float32, torch.bfloat16]
    assert [t.nbytes for t in parsed.tensors] == [2 * 3 * 4, 4 * 2]
    assert parsed.nbytes == 32 and not parsed.packed
    assert parsed.packed_buffer_size_bytes == DEFAULTS.packed_buffer_size_bytes


@pytest.mark.parametrize(
    ("update", "needle"),
    [
        (info(names="a"), "'names' as a list"),
        (info(shapes=[[2, 3]]), "one entry per tensor"),
        (info(dtype_names=["float32", "int64"]), "b: dtype 'int64' cannot be a weight"),
        (info(dtype_names=["float32", "float33"]), "float33"),
        (info(shapes=[[2, -3], [4]]), "a: shape must be a list of non-negative integers"),
        (info(shapes=[[2, True], [4]]), "a: shape"),
        (info(names=["a", "a"]), "'a' appears twice"),
        (info(packed="yes"), "'packed' must be true or false"),
        (info(packed_buffer_size_bytes=0), "'packed_buffer_size_bytes' must be an integer >= 1"),
        (info(tensor_sizes=[24, 9]), "b: tensor_sizes says 9 bytes but shape [4] of bfloat16 is 8 bytes"),
        (info(tensor_sizes=[24]), "tensor_sizes must have one entry per tensor (2)"),
        (info(load_format="auto"), "fields siesta does not take: ['load_format']"),
        ([1, 2], "update_info must be a JSON object"),
    ],
)
def test_each_malformed_declaration_is_refused_naming_it(update, needle):
    with pytest.raises(WeightTransferError) as err:
        parse_update_info(update, DEFAULTS)
    assert needle in str(err.value)


def test_nccl_init_info_is_checked_field_by_field():
    good = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    assert parse_nccl_init(good).world_size == 2
    for bad, needle in [
        (good | {"master_port": 70000}, "'master_port' must be at most 65535"),
        (good | {"world_size": 1}, "'world_size' must be an integer >= 2"),
        (good | {"rank_offset": 0}, "'rank_offset' must be an integer >= 1"),
        ({k: v for k, v in good.items() if k != "master_address"}, "'master_address'"),
        (good | {"group_name": "x"}, "does not take: ['group_name']"),
    ]:
        with pytest.raises(WeightTransferError) as err:
            parse_nccl_init(bad)
        assert needle in str(err.value)


@pytest.mark.parametrize("limit", [1, 7, 10, 11, 25, 1000])
def test_a_bucket_closes_with_the_tensor_that_takes_it_past_the_limit(limit):
    sizes = [4, 6, 1, 9, 3, 3, 12, 5]
    buckets = [sizes[a:b] for a, b in bucket_bounds(sizes, limit)]
    assert [s for b in buckets for s in b] == sizes  # every tensor once, in order
    for i, bucket in enumerate(buckets):
        assert bucket and sum(bucket[:-1]) <= limit  # nothing before the last tensor crossed it
        if i < len(buckets) - 1:
            assert sum(bucket) > limit  # only a crossing closes a bucket before the end


def test_buckets_of_a_worked_example():
    # 10 bytes a bucket: 4+6 is not past it, +1 is; 9+3 is; 3+12 is; 5 is what is left.
    assert bucket_bounds([4, 6, 1, 9, 3, 3, 12, 5], 10) == [(0, 3), (3, 5), (5, 7), (7, 8)]


def test_the_backend_is_configured_as_vllm_configures_it():
    import argparse

    from siesta.config import ConfigError, EngineConfig, WeightTransferConfig
    from siesta.entrypoints.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--weight-transfer-config", '{"backend": "ipc", "packed_buffer_size_bytes": 1048576}']
    config = engine_config(parser.parse_args(argv)).weight_transfer
    assert (config.backend, config.packed_buffer_size_bytes) == ("ipc", 1 << 20)
    assert EngineConfig.from_flags().weight_transfer == WeightTransferConfig()  # nccl, as vLLM
    for bad, needle in [({"backend": "rdma"}, "backend must be one of nccl, ipc"), ({"timeout_s": 0}, "timeout_s"),
                        ({"bucket": 1}, "unknown keys: ['bucket']"), ("{not json", "not valid JSON")]:  # fmt: skip
        with pytest.raises(ConfigError) as err:
            WeightTransferConfig.from_any(bad)
        assert needle in str(err.value)


def test_a_tensor_off_its_alignment_in_a_bucket_is_read_right():
    """After 3 bf16 values (6 bytes) an fp32 tensor starts at a byte offset no float32 view can take."""
    from siesta.weight_transfer.receivers import _split
    from siesta.weight_transfer.wire import TensorMeta

    half = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    full = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float32)
    bucket = torch.cat([half.view(torch.uint8), full.reshape(-1).view(torch.uint8)])
    (_, a), (_, b) = _split(bucket, [TensorMeta("h", torch.bfloat16, (3,)), TensorMeta("f", torch.float32, (2, 2))])
    assert torch.equal(a, half) and torch.equal(b, full)
