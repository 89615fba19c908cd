"""Shard-map deltas on the watch: the master's feed (kvstore.master.feed.MapFeed) and the
client's merge (kvstore_client.routing.merge_map) agree, full maps still go to watchers
that do not ask for deltas, and each message is serialized once."""

from __future__ import annotations

import asyncio
import random

from kvstore.master.feed import HISTORY, MapFeed
from kvstore.master.membership import Membership
from kvstore_client.proto import master_pb2
from kvstore_client.routing import merge_map

TOKEN = "t" * 32


def info(i: int, port: int = 1) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"w{i:04d}", grpc=f"h{i}:{port}", endpoints=[f"tcp://h{i}:{port}"], capacity_bytes=1
    )


def test_deltas_rebuild_every_version_exactly() -> None:
    """Random joins, leaves, drains and changed endpoints over 60 versions: a client
    applying each delta to what it holds ends with exactly the master's map, and a
    delta is far smaller than the map."""

    async def main() -> None:
        rnd = random.Random(5)
        m = Membership(10)
        for i in range(300):
            m.register(info(i), TOKEN, 0.0)
        feed = MapFeed(m.shard_map())
        held = merge_map(None, feed.next_for(0, True))
        assert held is not None and held == feed.current, "the first map is full"
        for _ in range(60):
            for _ in range(rnd.randint(1, 4)):
                i = rnd.randrange(320)
                op = rnd.random()
                wid = info(i).id
                if op < 0.3 and wid in m.members:
                    m.leave(wid, TOKEN, 0.0)
                elif op < 0.4 and wid in m.members:
                    m.heartbeat(wid, TOKEN, master_pb2.WorkerStats(), 0.0, draining=True)
                elif wid in m.members:
                    m.leave(wid, TOKEN, 0.0)
                    m.register(info(i, port=rnd.randint(2, 9)), TOKEN, 0.0)
                else:
                    m.register(info(i), TOKEN, 0.0)
            await feed.publish(m.shard_map())
            d = feed.next_for(held.version, True)
            assert d.base_version == held.version
            assert d.ByteSize() < feed.current.ByteSize() / 5
            held = merge_map(held, d)
            assert held == feed.current

    asyncio.run(main())


def test_watchers_without_deltas_and_unknown_versions_get_full_maps() -> None:
    async def main() -> None:
        m = Membership(10)
        m.register(info(1), TOKEN, 0.0)
        feed = MapFeed(m.shard_map())
        first = feed.current.version
        for i in range(2, 2 + HISTORY + 2):
            m.register(info(i), TOKEN, 0.0)
            await feed.publish(m.shard_map())
        cur = feed.current
        assert feed.next_for(cur.version - 1, False) is cur, "no deltas asked: the full map"
        assert feed.next_for(0, True) is cur
        assert feed.next_for(first, True) is cur, "forgotten base: the full map"
        assert feed.next_for(cur.version - 1, True).base_version == cur.version - 1
        d = feed.next_for(cur.version - 1, True)
        assert feed.next_for(cur.version - 1, True) is d, "computed once per base"
        assert feed.wire(d) is feed.wire(d), "serialized once"

    asyncio.run(main())


def test_merge_refuses_a_delta_for_another_map() -> None:
    full = master_pb2.ShardMap(version=5, workers=[info(1), info(2)], cluster_id="c")
    d = master_pb2.ShardMap(version=7, base_version=6, workers=[info(3)], removed=["w0001"])
    assert merge_map(full, d) is None, "the client holds 5, the delta starts at 6"
    assert merge_map(None, d) is None
    d.base_version = 5
    got = merge_map(full, d)
    assert got is not None and [w.id for w in got.workers] == ["w0002", "w0003"]
    assert got.version == 7 and got.base_version == 0 and not got.removed
    assert merge_map(full, full) is full, "a full map is itself"


def test_a_watch_sends_deltas_after_the_first_map() -> None:
    async def main() -> list[master_pb2.ShardMap]:
        m = Membership(10)
        for i in range(50):
            m.register(info(i), TOKEN, 0.0)
        feed = MapFeed(m.shard_map())
        got: list[master_pb2.ShardMap] = []

        async def watch() -> None:
            async for msg in feed.watch(0, True):
                got.append(msg)

        t = asyncio.create_task(watch())
        await asyncio.sleep(0.05)
        m.register(info(99), TOKEN, 0.0)
        await feed.publish(m.shard_map())
        await asyncio.sleep(0.3)
        m.leave("w0003", TOKEN, 0.0)
        await feed.publish(m.shard_map())
        await asyncio.sleep(0.3)
        t.cancel()
        return got

    got = asyncio.run(main())
    assert [g.base_version == 0 for g in got] == [True, False, False]
    assert [w.id for w in got[1].workers] == ["w0099"] and not got[1].removed
    assert not got[2].workers and list(got[2].removed) == ["w0003"]
