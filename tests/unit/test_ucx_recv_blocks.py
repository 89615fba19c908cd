"""recv_blocks (ucx://'s receive of a frame's payloads): every block's messages are
posted at once and in order, each block is reported as soon as its messages are in,
and a failure cancels and settles the receives still posted. A fake endpoint stands
in for UCX: no ucxx needed."""

from __future__ import annotations

import asyncio

import pytest

from kvstore_client.transport.ucx import recv_blocks


class FakeEndpoint:
    """Delivers queued messages to receives in the order they were posted; the
    message ``fail`` (an index) raises instead, and the messages after it never come
    (still posted when it fails, however late the loop runs: with timed arrivals a
    loaded machine could deliver the next one in the same loop pass as the failure)."""

    def __init__(self, messages: list[bytes], fail: int | None = None) -> None:
        self.messages = messages
        self.fail = fail
        self.posted: list[int] = []  # buffer sizes, in posting order
        self.cancelled = 0

    async def recv(self, buf: memoryview | bytearray) -> None:
        n = len(self.posted)
        self.posted.append(len(buf))
        try:
            if self.fail is not None and n > self.fail:
                await asyncio.Event().wait()  # never arrives
            await asyncio.sleep(0.001 * (n + 1))  # later messages arrive later
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if n == self.fail:
            raise ConnectionError("peer gone")
        buf[:] = self.messages[n]


def test_blocks_land_in_order_with_parts_and_empty_blocks() -> None:
    a, b1, b2, c = b"aaaa", b"bb", b"bbb", b"cccccc"
    ep = FakeEndpoint([a, b1, b2, c])
    blocks = [
        [bytearray(4)],
        [bytearray(2), bytearray(3)],  # one block in two parts
        [bytearray(0)],  # an empty value: no message
        [bytearray(6)],
    ]
    seen: list[tuple[int, bytes]] = []

    def landed(i: int) -> None:
        seen.append((i, b"".join(bytes(p) for p in blocks[i])))

    asyncio.run(recv_blocks(ep, blocks, landed))
    assert ep.posted == [4, 2, 3, 6], "one receive per non-empty buffer, in order"
    assert seen == [(0, a), (1, b1 + b2), (2, b""), (3, c)]


def test_a_failed_receive_cancels_the_rest_and_reports_no_later_block() -> None:
    ep = FakeEndpoint([b"x" * 4] * 5, fail=1)
    blocks = [[bytearray(4)] for _ in range(5)]
    seen: list[int] = []

    async def run() -> int:
        with pytest.raises(ConnectionError):
            await recv_blocks(ep, blocks, seen.append)
        return ep.cancelled  # before asyncio.run cancels whatever is left itself

    cancelled = asyncio.run(run())
    assert seen == [0]
    assert cancelled == 3, "the receives still posted were cancelled and settled"
