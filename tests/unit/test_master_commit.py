"""The master servicer's group commit and failover grace, without a network: a fake
HA coordinator counts the etcd writes."""

from __future__ import annotations

import asyncio
import time

from kvstore.master.membership import Membership
from kvstore.master.server import MasterServicer
from kvstore.master.snapshot import Layout, Snapshot
from kvstore_client.proto import master_pb2


class FakeHa:
    """Stands in for HaCoordinator: always leads, each persist takes 10 ms."""

    is_leader = True
    leader_address = ""

    def __init__(self) -> None:
        self.layout = Layout("c")
        self.writes: list[dict[bytes, bytes]] = []

    async def persist(self, state: dict[bytes, bytes]) -> None:
        await asyncio.sleep(0.01)
        self.writes.append(state)


def _info(i: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"w{i}", grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1
    )


def test_a_burst_of_registrations_is_one_or_two_etcd_writes() -> None:
    async def main() -> tuple[FakeHa, MasterServicer]:
        s = MasterServicer(Membership(10))
        ha = FakeHa()
        s.ha = ha  # type: ignore[assignment]

        async def join(i: int) -> None:
            s.m.register(_info(i), "t" * 32, 0.0)
            await s._bump()
            # on return, etcd and the published map hold this worker
            assert any(f"w{i}".encode() in k for k in ha.writes[-1])
            assert f"w{i}" in {w.id for w in s.published.workers}

        await asyncio.gather(*(join(i) for i in range(200)))
        return ha, s

    ha, s = asyncio.run(main())
    assert 1 <= len(ha.writes) <= 3, f"{len(ha.writes)} etcd writes for 200 registrations"
    assert len(s.published.workers) == 200


def test_a_failed_write_reaches_every_waiter() -> None:
    class Down(FakeHa):
        async def persist(self, state: dict[bytes, bytes]) -> None:
            raise RuntimeError("etcd down")

    async def main() -> list[BaseException | None]:
        s = MasterServicer(Membership(10))
        s.ha = Down()  # type: ignore[assignment]
        s.m.register(_info(1), "t" * 32, 0.0)
        return await asyncio.gather(*(s._bump() for _ in range(5)), return_exceptions=True)

    out = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) for e in out)


def test_a_new_leader_expires_nobody_for_a_grace_period() -> None:
    async def main() -> tuple[set[str], set[str]]:
        s = MasterServicer(Membership(0.2))
        snap = Snapshot(version=5, workers={"w1": (_info(1), False, "t" * 32)})
        await s.become_leader(snap)  # no ha: publish and start expiry
        await asyncio.sleep(0.3)  # past the TTL, within the grace
        during = set(s.m.members)
        await asyncio.sleep(0.4)  # past TTL + grace
        after = set(s.m.members)
        s.stop_expiry()
        return during, after

    during, after = asyncio.run(main())
    assert during == {"w1"}, "no worker expires right after a takeover"
    assert after == set(), "a worker that never came back expires after the grace"


def test_watchers_get_fewer_maps_under_sustained_churn() -> None:
    """A change every 20 ms for 2.5 s: a watcher gets the first at once and then at
    most a few (the pause doubles from 0.1 s to 1 s), always ending on the latest."""

    async def main() -> tuple[list[int], int]:
        s = MasterServicer(Membership(10))
        got: list[int] = []

        async def watch() -> None:
            req = master_pb2.WatchShardMapRequest(known_version=0)
            async for m in s.WatchShardMap(req, None):  # type: ignore[arg-type]
                got.append(m.version)

        t = asyncio.create_task(watch())
        bumps = []
        for i in range(125):
            s.m.register(_info(i), "t" * 32, 0.0)
            bumps.append(asyncio.create_task(s._bump()))
            await asyncio.sleep(0.02)
        await asyncio.gather(*bumps)
        await asyncio.sleep(1.2)
        t.cancel()
        return got, s.published.version

    got, last = asyncio.run(main())
    assert got[-1] == last, "the watcher ends on the latest map"
    assert len(got) <= 9, f"{len(got)} maps sent for 125 changes in 2.5 s"


def test_a_master_that_is_behind_expires_nobody() -> None:
    """The event loop blocked for longer than the TTL (a CPU-starved master): the
    workers' heartbeats may be waiting unread, so nobody expires on that tick."""

    async def main() -> tuple[set[str], set[str]]:
        s = MasterServicer(Membership(0.3))  # a hard limit of 3 TTLs: 0.9 s
        s.m.register(_info(1), "t" * 32, time.monotonic())
        s.m.bind("w1", "t" * 32, time.monotonic())  # it beats: the plain TTL from here
        s.start_expiry()
        await asyncio.sleep(0.03)
        time.sleep(0.5)  # the loop is stuck: no heartbeat could be read meanwhile
        await asyncio.sleep(0.1)
        during = set(s.m.members)
        await asyncio.sleep(0.5)  # caught up, still silent for a TTL: expired
        after = set(s.m.members)
        s.stop_expiry()
        return during, after

    during, after = asyncio.run(main())
    assert during == {"w1"}, "a lagging master expired a worker it may not have heard"
    assert after == set()
