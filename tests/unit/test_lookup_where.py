"""The client's half of the tier lookup (kvstore_client.transport.where): the best copy
of a replicated key wins, and a worker that refuses wire.FLAG_WHERE is asked plain
EXISTS (hits WHERE_UNKNOWN) for a while, a refusal counting as the worker's only once
the plain EXISTS is answered."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_client import WHERE_ABSENT, WHERE_DRAM, WHERE_SSD, WHERE_UNKNOWN, InvalidArgument
from kvstore_client.transport import where

ALL = [WHERE_ABSENT, WHERE_DRAM, WHERE_SSD, WHERE_UNKNOWN]


def test_the_best_copy_wins_in_any_order() -> None:
    # DRAM, then a hit of unknown tier (it may be in DRAM), then SSD, then absent
    order = [WHERE_ABSENT, WHERE_SSD, WHERE_UNKNOWN, WHERE_DRAM]
    for a in ALL:
        for b in ALL:
            out = np.zeros(3, dtype=np.uint8)
            idx = np.array([0, 2])
            where.merge(out, idx, np.array([a, a], dtype=np.uint8))
            where.merge(out, idx, np.array([b, b], dtype=np.uint8))
            want = max(a, b, key=order.index)
            assert out.tolist() == [want, WHERE_ABSENT, want], (a, b)


def test_plain_exists_hits_are_of_unknown_tier() -> None:
    assert where.unknown_tier([True, False]).tolist() == [WHERE_UNKNOWN, WHERE_ABSENT]
    assert where.unknown_tier(np.zeros(0, dtype=bool)).tolist() == []


def test_a_refusing_worker_is_asked_plain_exists_until_the_retry() -> None:
    support = where.WhereSupport()
    calls: list[str] = []

    def refuse() -> np.ndarray:
        calls.append("where")
        raise InvalidArgument("unknown EXISTS flags 0x2")

    def plain() -> list[bool]:
        calls.append("exists")
        return [True, False]

    assert where.where_or_exists(support, refuse, plain).tolist() == [WHERE_UNKNOWN, 0]
    assert calls == ["where", "exists"] and not support.asks
    assert where.where_or_exists(support, refuse, plain).tolist() == [WHERE_UNKNOWN, 0]
    assert calls == ["where", "exists", "exists"], "not asked the flag again meanwhile"
    support.plain_until = 0.0
    assert support.asks

    def answer() -> np.ndarray:
        return np.array([WHERE_SSD, WHERE_DRAM], dtype=np.uint8)

    assert where.where_or_exists(support, answer, plain).tolist() == [WHERE_SSD, WHERE_DRAM]


def test_a_refusal_the_plain_exists_shares_is_the_callers() -> None:
    support = where.WhereSupport()

    def refuse() -> np.ndarray:
        raise InvalidArgument("bad namespace")

    def refuse_too() -> list[bool]:
        raise InvalidArgument("bad namespace")

    with pytest.raises(InvalidArgument):
        where.where_or_exists(support, refuse, refuse_too)
    assert support.asks, "not taken for a worker that predates the flag"
