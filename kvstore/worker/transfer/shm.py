"""Server half of the shm:// transport: hand out arena locations, pin, commit.

A same-host client maps the worker's arena file itself and copies bytes
directly; the worker only answers where blocks live (over the tcp:// control
connection) and keeps them from being freed or reused while a copy is in
flight. Blocks that are not in the arena (SSD hits) come back inline.

The client is trusted with the checksums it reports for shm writes (it can
write the whole arena anyway); every read is verified by the reader.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from kvstore_client import wire
from kvstore_client.errors import (
    InvalidArgument,
    ProtocolError,
    QuotaExceeded,
    ResourceExhausted,
)
from kvstore_client.keys import HASH_LEN

from ..store import BlockStore, Reading
from ..tiers.dram import Block

MAX_OPEN = 64  # LOC requests a connection may hold open at once


@dataclass(slots=True)
class ShmState:
    """What one connection holds: pinned reads and reserved slots, by request id."""

    readings: dict[int, Reading] = field(default_factory=dict)
    reserved: dict[int, list[Block | ResourceExhausted | None]] = field(default_factory=dict)

    def close(self, store: BlockStore) -> None:
        """The connection is gone: release its pins, abort its reservations."""
        for r in self.readings.values():
            store.done(r)
        for slots in self.reserved.values():
            blocks = [b for b in slots if isinstance(b, Block)]
            store.finish_many(blocks, [False] * len(blocks))
        self.readings.clear()
        self.reserved.clear()


def _hashes(conn: socket.socket, count: int) -> list[bytes]:
    raw = bytes(wire.recv_exact(conn, count * HASH_LEN))
    return [raw[i : i + HASH_LEN] for i in range(0, len(raw), HASH_LEN)]


def get_loc(store: BlockStore, st: ShmState, conn: socket.socket, h: wire.Header, ns: str) -> int:
    """Answer locations (pinned) or inline bytes; returns inline payload bytes sent."""
    if len(st.readings) + len(st.reserved) >= MAX_OPEN:
        raise ProtocolError("too many unreleased shm requests on one connection")
    keys = _hashes(conn, h.count)
    reading = store.read(ns, keys, verify_dram=False)
    meta = bytearray(h.count * wire.LOC_ENTRY.size)
    inline: list[memoryview] = []
    for i, held in enumerate(reading.held):
        off = i * wire.LOC_ENTRY.size
        if held is None:
            wire.LOC_ENTRY.pack_into(meta, off, wire.GET_MISS, 0, 0, 0)
        elif held.block is not None:
            b = held.block
            wire.LOC_ENTRY.pack_into(meta, off, wire.LOC_ARENA, b.size, b.checksum, b.offset)
        else:
            wire.LOC_ENTRY.pack_into(meta, off, wire.LOC_INLINE, len(held.view), held.checksum, 0)
            inline.append(held.view)
    st.readings[h.req_id] = reading
    try:
        head = wire.encode_answer_header(h.op, 0, h.count, h.req_id)
        wire.send_buffers(conn, [head, meta, *inline])
    finally:
        if inline and reading.txn is not None:
            # SSD views went out inline; keep DRAM pins, end the LMDB transaction early.
            reading.txn.abort()
            reading.txn = None
    return sum(len(v) for v in inline)


def release(store: BlockStore, st: ShmState, h: wire.Header) -> None:
    reading = st.readings.pop(h.req_id, None)
    if reading is not None:
        store.done(reading)
        return
    slots = st.reserved.pop(h.req_id, None)
    if slots is not None:
        blocks = [b for b in slots if isinstance(b, Block)]
        store.finish_many(blocks, [False] * len(blocks))


def put_loc(store: BlockStore, st: ShmState, conn: socket.socket, h: wire.Header, ns: str) -> None:
    if len(st.readings) + len(st.reserved) >= MAX_OPEN:
        raise ProtocolError("too many unreleased shm requests on one connection")
    raw = wire.recv_exact(conn, h.count * wire.PUT_ENTRY.size)
    entries = list(wire.PUT_ENTRY.iter_unpack(raw))
    limit = store.max_value_size
    for i, (_, size, _) in enumerate(entries):
        if size > limit:
            raise InvalidArgument(f"value {i} of {size} bytes exceeds the limit of {limit}")
    slots = store.reserve_many(
        ns, [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]
    )
    answer = bytearray(h.count * wire.PUT_LOC_ENTRY.size)
    for i, s in enumerate(slots):
        off = i * wire.PUT_LOC_ENTRY.size
        if isinstance(s, Block):
            wire.PUT_LOC_ENTRY.pack_into(answer, off, wire.PUT_LOC_SLOT, s.offset)
        elif isinstance(s, ResourceExhausted):
            full = wire.PUT_QUOTA if isinstance(s, QuotaExceeded) else wire.PUT_FULL
            wire.PUT_LOC_ENTRY.pack_into(answer, off, full, 0)
        else:
            wire.PUT_LOC_ENTRY.pack_into(answer, off, wire.PUT_PRESENT, 0)
    st.reserved[h.req_id] = slots
    wire.send_buffers(conn, [wire.encode_answer_header(h.op, 0, h.count, h.req_id), answer])


def put_commit(
    store: BlockStore, st: ShmState, conn: socket.socket, h: wire.Header, ns: str
) -> int:
    """Commit the slots the client wrote; returns payload bytes committed."""
    # Read the flags first: until they are in, the reservation stays with the
    # connection, so a peer that vanishes here has it aborted by ShmState.close.
    flags = bytes(wire.recv_exact(conn, h.count))
    slots = st.reserved.get(h.req_id)
    if slots is None or len(slots) != h.count:
        raise ProtocolError(f"PUT_COMMIT for unknown or mismatched request {h.req_id}")
    del st.reserved[h.req_id]
    blocks: list[Block] = []
    ok: list[bool] = []
    status = bytearray(h.count)
    for i, (s, f) in enumerate(zip(slots, flags, strict=True)):
        if isinstance(s, Block):
            blocks.append(s)
            ok.append(bool(f))
            status[i] = wire.PUT_STORED if f else wire.PUT_CORRUPT
        else:
            if isinstance(s, QuotaExceeded):
                status[i] = wire.PUT_QUOTA
            elif isinstance(s, ResourceExhausted):
                status[i] = wire.PUT_FULL
            else:
                status[i] = wire.PUT_PRESENT
    store.finish_many(blocks, ok)
    wire.send_buffers(conn, [wire.encode_answer_header(h.op, 0, h.count, h.req_id), status])
    return sum(b.size for b, good in zip(blocks, ok, strict=True) if good)
