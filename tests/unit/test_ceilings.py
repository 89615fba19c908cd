"""The ceilings: small, fast measurements that must come back positive and finite."""

from __future__ import annotations

import math

import pytest

from kvstore_bench.transfer import ceilings


def test_memcpy_is_positive() -> None:
    v = ceilings.memcpy_gib_s(1 << 20, seconds=0.02, repeats=1)
    assert 0 < v < 10_000 and math.isfinite(v)


def test_socket_stream_is_positive() -> None:
    v = ceilings.socket_stream_gib_s(8 << 20, repeats=1, chunk=1 << 18)
    assert 0 < v < 10_000 and math.isfinite(v)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ceilings.memcpy_gib_s(0)
    with pytest.raises(ValueError):
        ceilings.socket_stream_gib_s(0)


def test_json_shape() -> None:
    c = ceilings.Ceilings(1.5, 2.5, 3.0, 0.1)
    assert c.to_json() == {
        "memcpy_gib_s": 1.5,
        "socket_gib_s": 2.5,
        "copy_hash_gib_s": 3.0,
        "copy_hash_cpu_s_per_gib": 0.1,
    }


def test_a_verified_copy_is_measured_with_its_cpu() -> None:
    gib_s, cpu = ceilings.copy_hash(8 << 20, 0.05, 1)
    assert gib_s > 0 and 0 < cpu < 10


def test_several_socket_streams_are_positive_and_one_is_the_single_stream() -> None:
    v = ceilings.socket_streams_gib_s(3, 12 << 20, repeats=1, chunk=1 << 18)
    assert 0 < v < 10_000 and math.isfinite(v)
    one = ceilings.socket_streams_gib_s(1, 8 << 20, repeats=1, chunk=1 << 18)
    assert 0 < one < 10_000
    with pytest.raises(ValueError):
        ceilings.socket_streams_gib_s(0)


def test_client_streams_are_workers_times_concurrency_above_one() -> None:
    assert ceilings.client_streams([1], 4) == [4]
    assert ceilings.client_streams([1, 4], 4) == [4]
    assert ceilings.client_streams([1, 2, 8], 1) == [2, 8]
    assert ceilings.client_streams([1], 1) == []


def test_same_host_ceilings_add_the_streams_a_batch_uses() -> None:
    from kvstore_bench.transfer.samehost import ceilings_3x

    one = ceilings_3x(4 << 20)
    assert len(one["socket_gib_s"]) == 3 and "socket_streams" not in one
    two = ceilings_3x(4 << 20, streams=2)
    runs = two["socket_streams"]["2"]["runs"]
    assert len(runs) == 3 and all(0 < x < 10_000 for x in runs)
