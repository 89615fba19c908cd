"""The ceilings: small, fast measurements that must come back positive and finite."""

from __future__ import annotations

import math

import pytest

from kvstore_bench import ceilings


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
    c = ceilings.Ceilings(1.5, 2.5)
    assert c.to_json() == {"memcpy_gib_s": 1.5, "socket_gib_s": 2.5}
