"""ucx:// packed streams without UCX: the codec (Packer, Unpacker) cuts and joins any
blocks at any chunk boundary; the StagingPool bounds its buffers, lets every frame go
on with one, and gives everything back once idle; send_packed / recv_packed copy
through at most PACK_WINDOW buffers per frame (a fake endpoint stands in for UCX)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvstore_client.transport.ucx import recv_packed, send_packed
from kvstore_client.transport.ucxcodec import (
    PACK_CHUNK,
    PACK_WINDOW,
    Packer,
    StagingPool,
    Unpacker,
    chunk_sizes,
)


def test_chunk_sizes() -> None:
    assert chunk_sizes(0) == []
    assert chunk_sizes(5) == [5]
    assert chunk_sizes(PACK_CHUNK) == [PACK_CHUNK]
    assert chunk_sizes(2 * PACK_CHUNK + 3) == [PACK_CHUNK, PACK_CHUNK, 3]


@pytest.mark.parametrize("seed", range(20))
def test_pack_and_unpack_any_blocks_at_any_boundaries(seed: int) -> None:
    rng = random.Random(seed)
    values = [rng.randbytes(rng.choice([0, 1, 7, 100, 5000])) for _ in range(rng.randint(1, 40))]
    stream = b"".join(values)
    # the sender's blocks: whole buffers or parts
    sources: list[bytes] = []
    for v in values:
        cut = rng.randint(0, len(v))
        sources += [v[:cut], v[cut:]] if rng.random() < 0.3 else [v]
    chunk = rng.choice([1, 3, 64, 4096, len(stream) or 1])
    packer = Packer(sources)
    chunks = []
    for at in range(0, len(stream), chunk):
        buf = memoryview(bytearray(min(chunk, len(stream) - at)))
        packer.fill(buf)
        chunks.append(buf)
    assert b"".join(bytes(c) for c in chunks) == stream
    # the receiver's destinations: whole, parts, or skipped
    dests: list[list[memoryview] | None] = []
    outs: list[bytearray | None] = []
    for v in values:
        if rng.random() < 0.2:
            dests.append(None)
            outs.append(None)
            continue
        out = bytearray(len(v))
        cut = rng.randint(0, len(v))
        m = memoryview(out)
        dests.append([m[:cut], m[cut:]] if rng.random() < 0.5 else [m])
        outs.append(out)
    un = Unpacker(dests, [len(v) for v in values])
    done = un.begin()
    for c in chunks:
        done += un.feed(c)
    assert done == list(range(len(values))), "every block completes once, in order"
    assert un.complete
    for v, out in zip(values, outs, strict=True):
        assert out is None or bytes(out) == v


def test_a_stream_longer_or_shorter_than_its_blocks_is_an_error() -> None:
    with pytest.raises(ValueError):
        Unpacker([None], [3]).feed(memoryview(b"abcd"))
    with pytest.raises(ValueError):
        Packer([b"ab"]).fill(memoryview(bytearray(3)))


def test_the_pool_is_bounded_and_every_frame_gets_one_buffer() -> None:
    async def go() -> None:
        pool = StagingPool(3 * PACK_CHUNK, idle_s=0.05)
        a = await pool.take(2)
        b = await pool.take(2)  # only one left: takes it without waiting
        assert (len(a), len(b), pool.leased) == (2, 1, 3)
        waiter = asyncio.ensure_future(pool.take(2))
        await asyncio.sleep(0.01)
        assert not waiter.done() and pool.waits == 1, "all leased: the next frame waits"
        pool.give(b)
        c = await asyncio.wait_for(waiter, 1.0)
        assert len(c) == 1 and c[0] is b[0], "a given-back buffer is reused"
        pool.give(a, reuse=False)  # a failed frame's buffers are never handed out again
        pool.give(c)
        assert pool.leased == 0 and pool.resident_bytes == PACK_CHUNK
        await asyncio.sleep(0.1)
        assert pool.resident_bytes == 0, "idle: everything given back"
        d = await pool.take(1)
        assert d[0] is not c[0]
        pool.give(d)

    asyncio.run(go())


def test_a_cancelled_wait_passes_its_turn_on() -> None:
    async def go() -> None:
        pool = StagingPool(PACK_CHUNK)
        held = await pool.take(1)
        first = asyncio.ensure_future(pool.take(1))
        second = asyncio.ensure_future(pool.take(1))
        await asyncio.sleep(0.01)
        pool.give(held)
        first.cancel()  # woken, then cancelled before it ran
        got = await asyncio.wait_for(second, 1.0)
        assert len(got) == 1
        pool.give(got)

    asyncio.run(go())


class FakeEndpoint:
    """Messages sent are queued; receives take them in order (each with a short delay,
    so the window is visible). Counts the buffers posted at once."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.posted = 0
        self.most_posted = 0

    async def send(self, buf: memoryview) -> None:
        await asyncio.sleep(0.001)
        self.queue.put_nowait(bytes(buf))

    async def recv(self, buf: memoryview) -> None:
        self.posted += 1
        self.most_posted = max(self.most_posted, self.posted)
        try:
            msg = await self.queue.get()
            await asyncio.sleep(0.001)
            buf[: len(msg)] = msg
        finally:
            self.posted -= 1


def test_send_and_recv_packed_copy_through_a_bounded_window() -> None:
    async def go() -> None:
        ep = FakeEndpoint()
        sender, receiver = StagingPool(64 * PACK_CHUNK), StagingPool(64 * PACK_CHUNK)
        values = [bytes([i % 251]) * (PACK_CHUNK // 3 + i) for i in range(10)]
        total = sum(len(v) for v in values)
        await send_packed(ep, [b"head"], values, total, sender)
        assert await ep.queue.get() == b"head"
        outs = [bytearray(len(v)) for v in values]
        landed: list[int] = []
        un = Unpacker([[memoryview(o)] for o in outs], [len(v) for v in values])
        await recv_packed(ep, total, un, receiver, landed.append)
        assert outs == [bytearray(v) for v in values] and landed == list(range(10))
        assert ep.most_posted <= PACK_WINDOW
        assert sender.peak <= PACK_WINDOW and receiver.peak <= PACK_WINDOW
        assert sender.leased == receiver.leased == 0
        # a stream of one chunk: one message, sent with the head
        small = [b"", b"abc", b"d" * 5000, b""]
        await send_packed(ep, [b"h1", b"h2"], small, 5003, sender)
        assert [await ep.queue.get() for _ in range(3)] == [b"h1", b"h2", b"".join(small)]
        outs = [bytearray(len(v)) for v in small]
        landed.clear()
        un = Unpacker([[memoryview(o)] for o in outs], [len(v) for v in small])
        ep.queue.put_nowait(b"".join(small))
        await recv_packed(ep, 5003, un, receiver, landed.append)
        assert outs == [bytearray(v) for v in small] and landed == [0, 1, 2, 3]

    asyncio.run(go())


def test_a_failed_receive_cancels_the_rest_and_reuses_nothing() -> None:
    class Broken(FakeEndpoint):
        async def recv(self, buf: memoryview) -> None:
            if self.posted:
                await asyncio.Event().wait()  # never arrives
            self.posted += 1
            raise ConnectionError("peer gone")

    async def go() -> None:
        pool = StagingPool(8 * PACK_CHUNK)
        un = Unpacker([None], [3 * PACK_CHUNK])
        with pytest.raises(ConnectionError):
            await recv_packed(Broken(), 3 * PACK_CHUNK, un, pool, lambda i: None)
        assert pool.leased == 0 and pool.resident_bytes == 0

    asyncio.run(go())
