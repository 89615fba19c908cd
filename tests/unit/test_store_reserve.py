"""BlockStore.reserve_many: the quota-free fast path gives what the per-key path gives."""

from __future__ import annotations

import os
import tempfile

from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.blocks import Block
from kvstore_client.errors import QuotaExceeded, ResourceExhausted

MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def summary(res: list[Block | ResourceExhausted | None]) -> list[object]:
    return [
        (r.size, r.checksum, r.slot_size) if isinstance(r, Block) else type(r).__name__ for r in res
    ]


def test_free_and_charged_namespaces_reserve_alike_and_quotas_still_hold() -> None:
    with tempfile.TemporaryDirectory() as d:
        arena = Arena(8 * MiB, d)
        try:
            st = BlockStore(arena, 1 * MiB, pins={"quota": 3 * 4096 + 64})
            assert not st.policy.charges("free") and st.policy.charges("quota")
            sizes = [4096, 4096, 4000, 4096, 100]
            keys = [k(1), k(1), k(2), k(3), k(4)]  # k(1) twice: the second is present
            free = st.reserve_many("free", keys, sizes, list(range(5)))
            charged = st.reserve_many("quota", keys, sizes, list(range(5)))
            assert summary(free)[:4] == summary(charged)[:4]
            assert summary(free)[1] == "NoneType"  # pending: first writer wins
            assert isinstance(charged[4], QuotaExceeded), "the quota still applies"
            assert isinstance(free[4], Block)
            st.finish_many([b for b in free if isinstance(b, Block)], [True] * 4)
            again = st.reserve_many("free", [k(1), k(2)], [4096, 4096], [0, 1])
            assert again == [None, None]
            skipped = st.tier.counters.skipped
            assert skipped >= 3
            assert st.exists("free", [k(1), k(2), k(3), k(4), k(5)]) == [True] * 4 + [False]
            for b in charged:
                if isinstance(b, Block):
                    st.finish_many([b], [False])
            assert st.quota.used["quota"] == 0, "aborts refund the quota"
            st.close()
        finally:
            arena.close()
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
