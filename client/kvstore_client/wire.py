"""The transfer-plane frame codec, shared by the client and the worker.

A connection carries requests and answers in order (a client may pipeline).
All integers are little-endian.

Request  = header(20) | namespace(ns_len) | body
  header = magic b"KVQ1" | op u8 | flags u8 | ns_len u16 | count u32 | req_id u64
  PUT     body: count x (hash 16 | size u32 | xxh3_64 u64)  then the payloads, in order
  GET     body: count x hash 16
  EXISTS  body: count x hash 16
          flags: FLAG_PREFIX asks only for the length of the leading run of present keys;
          FLAG_WHERE asks in which tier each key is (not with FLAG_PREFIX: refused)
  REMOVE  body: count x hash 16

Answer   = header(20) | body
  header = magic b"KVA1" | op u8 | code u8 | tag u16 | count u32 | req_id u64
           (tag: the worker's arena tag in shm answers, else 0; decoded into ns_len)
  code != 0: body is `count` bytes of UTF-8 message; the server closes after it
  PUT     body: count x status u8 (PUT_STORED, PUT_PRESENT, PUT_FULL, PUT_CORRUPT, PUT_QUOTA)
  GET     body: count x (status u8 | pad 3 | size u32 | xxh3_64 u64)  then the found payloads
  EXISTS  body: ceil(count/8) bytes of bitmap (see keys.to_bitmap); with FLAG_PREFIX
          (workers that know it) tag = TAG_RUN, count = the leading run, no body.
          A worker that predates FLAG_PREFIX ignores it and sends the bitmap (tag 0).
          With FLAG_WHERE, tag = TAG_WHERE and the body is two bitmaps of ceil(count/8)
          bytes each: present, then "off DRAM" (on SSD, or a staged copy on its way
          there, and not in DRAM); see encode_where / decode_where and WHERE_*.
          A worker that predates FLAG_WHERE refuses it (INVALID_ARGUMENT, then closes
          the connection); clients fall back to the plain bitmap (WHERE_UNKNOWN hits).
  REMOVE  body: empty; count = number removed

Same-host shared memory (shm://) uses the same connection for control only. The
client maps the worker's arena read-only (sealed: nobody but the worker can write it)
and copies blocks out itself; it writes blocks into its own *inbox*, memory that only
it and the worker share, and the worker copies them into the arena, verifying each
against the checksum the writer took over its source (docs/SECURITY.md):
  GET_LOC    body: count x hash 16
             answer: count x (status u8 | pad 3 | size u32 | xxh3_64 u64 | offset u64),
             then the payloads of INLINE entries (blocks not in the arena, e.g. on SSD).
             LOC entries stay pinned until the client sends RELEASE with this req_id.
  RELEASE    no body, no answer; req_id names the GET_LOC to release.
  PUT_INBOX  body: count x (hash 16 | size u32 | xxh3_64 u64 | offset u64): blocks the
             client wrote into its inbox at those offsets (flags: FLAG_SESSION); only
             on a connection whose AUTH carried the identity its inbox was handed to.
             answer: count x status u8 (PUT_*): PUT_CORRUPT when the bytes the worker
             copied do not match the checksum (the key stays absent).
  (ops 7 and 8, PUT_LOC / PUT_COMMIT, wrote into a shared writable arena: retired.)

With tenants configured, a connection's first frame is AUTH (ns_len 0, count =
token length, body = the token); the answer is OK or UNAUTHENTICATED (then closed).
With FLAG_IDENTITY the body starts with the client's 16-byte identity (count includes
it; kvstore_client.security): the worker then counts what this connection holds with
the client's other connections (and its hazard page), not by the peer's address.
Without tenants a client sends AUTH only to say who it is.
A frame for a namespace the tenant does not own is answered PERMISSION_DENIED
and the connection is closed. With TLS, the connection is wrapped before any frame.

Every worker transport checks a request in one order (kvstore/worker/transfer/frames.py):
magic and op; AUTH (with tenants the first frame, else allowed only first); namespace
length 1..255; the op is served by this transport (ucx:// serves PUT, GET, EXISTS and
REMOVE); the flags are known for the op (EXISTS: FLAG_PREFIX or FLAG_WHERE, not
both); count <= the worker's max batch; then the
namespace's syntax and ownership; then the body. A bad magic, op, namespace length or
misplaced AUTH closes the connection unanswered; every other refusal is answered
(INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED) and then closes it.

Payload bytes are never pickled or copied into the frame: senders pass them as
separate buffers to ``sendmsg`` and receivers ``recv_into`` their destination.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash

from .errors import ProtocolError

Buffer: TypeAlias = bytes | bytearray | memoryview
# A block as the transports take it: one buffer, or an ordered list of parts
# (byte views) that the wire carries as one value of their total size.
Block: TypeAlias = Buffer | list[memoryview]

REQ_MAGIC = b"KVQ1"
ANS_MAGIC = b"KVA1"
HEADER = struct.Struct("<4sBBHIQ")
HEADER_LEN = HEADER.size  # 20
PUT_ENTRY = struct.Struct("<16sIQ")  # 28
GET_ENTRY = struct.Struct("<B3xIQ")  # 16

OP_PUT = 1
OP_GET = 2
OP_EXISTS = 3
OP_REMOVE = 4
OP_GET_LOC = 5
OP_RELEASE = 6
OP_PUT_LOC = 7
OP_PUT_COMMIT = 8
OP_AUTH = 9
OP_PUT_INBOX = 10
OPS = frozenset(range(1, 11))
MAX_TOKEN = 4096

PUT_STORED = 0
PUT_PRESENT = 1
PUT_FULL = 2
PUT_CORRUPT = 3
PUT_TOO_LARGE = 4
PUT_QUOTA = 5
PUT_DECLINED = 6  # not admitted: its session holds its share of the worker (not an error)

GET_HIT = 1
GET_MISS = 0
LOC_ARENA = 1  # bytes are in the arena at the offset
LOC_INLINE = 2  # bytes follow inline in the answer
PUT_LOC_SLOT = 0  # reserved: write the slot, then commit
LOC_ENTRY = struct.Struct("<B3xIQQ")  # 24
PUT_LOC_ENTRY = struct.Struct("<B7xQ")  # 16
INBOX_ENTRY = struct.Struct("<16sIQQ")  # 36: hash, size, xxh3_64 of the source, inbox offset

# shm:// hand-over (version 2). The client speaks first: SHM_REQUEST (magic, version,
# token length, its identity) and the token. The worker answers SHM_HELLO (magic, arena
# id, arena size, inbox size, hazard budget in bytes, flags) with descriptors attached:
# the arena (read-only), then with SHM_HAS_INDEX the index (read-only) and the client's
# hazard page, then with SHM_HAS_INBOX the client's inbox (read-write, its own).
SHM_REQ_MAGIC = b"KVSR"
SHM_VERSION = 2
SHM_REQUEST = struct.Struct("<4sHH16s")
SHM_MAGIC = b"KVS2"
SHM_HELLO = struct.Struct("<4s8sQQQI4x")
SHM_HAS_INDEX = 1
SHM_HAS_INBOX = 2

MAX_BATCH = 1 << 16
IOV_MAX = 1024

# Request flag (ucx:// only): blocks travel as several messages, one per part; the
# body then carries a part count per block and a part-size table follows (see
# kvstore_client.transport.ucx).
FLAG_PARTS = 1
MAX_PARTS = 4096  # parts per block
# Request flag (PUT, PUT_LOC): the writer sends session hints, so session shares apply
# to its blocks (a session over its share has them declined). Blocks of writers
# without it are always admitted (see docs/OPERATIONS.md, sessions).
FLAG_SESSION = 2
# Request flag (EXISTS): answer only how many leading keys are present (the worker
# stops at its first miss); the answer carries TAG_RUN and the run in its count.
FLAG_PREFIX = 1
SUMS = struct.Struct("<Q")
# Request flag (EXISTS): answer per key in which tier it is (TAG_WHERE, two bitmaps:
# present, then off DRAM); with FLAG_PREFIX it is refused (INVALID_ARGUMENT).
FLAG_WHERE = 2
# Per key, where a lookup found it (Client.batch_where, Client.where_local):
WHERE_ABSENT = 0  # no owner holds it (or no owner answered)
WHERE_DRAM = 1  # in a worker's DRAM (its arena): a host-memory hit
WHERE_SSD = 2  # only on a worker's SSD tier (evicted from DRAM): a disk hit
WHERE_UNKNOWN = 3  # present, tier unknown: its owner predates FLAG_WHERE
# Request flag (ucx:// PUT and GET): the frame's payloads travel packed, at most
# MAX_PACKED bytes back to back (PUT: the blocks, not with FLAG_PARTS; GET: the hits,
# when the worker answers with TAG_PACKED), cut into messages of
# transport.ucxcodec.PACK_CHUNK bytes. Per message UCX pays a rendezvous, so many
# small blocks or parts cost far more than a copy.
FLAG_PACKED = 8
MAX_PACKED = 64 << 20
# Request flag (AUTH): the body starts with the client's 16-byte identity.
FLAG_IDENTITY = 1
IDENTITY = 16
TAG_RUN = 1
TAG_PACKED = 2  # a GET answer (ucx://) whose hits follow as one packed message
TAG_WHERE = 3  # an EXISTS answer to FLAG_WHERE: two bitmaps (present, off DRAM)
PART_COUNT = struct.Struct("<I")


def runs(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Cut consecutive items into (start, end) runs of at most ``limit`` bytes each,
    and at least one item each."""
    out: list[tuple[int, int]] = []
    start, acc = 0, 0
    for j, s in enumerate(sizes):
        if j > start and acc + s > limit:
            out.append((start, j))
            start, acc = j, 0
        acc += s
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def block_size(b: Block) -> int:
    """Bytes of a block (the sum of its parts' sizes)."""
    if isinstance(b, list):
        return sum(p.nbytes for p in b)
    return b.nbytes if isinstance(b, memoryview) else len(b)


def block_parts(b: Block) -> Sequence[Buffer]:
    """A block's buffers, in order (one for a whole value)."""
    return b if isinstance(b, list) else (b,)


def block_checksum(b: Block) -> int:
    """xxh3-64 of a block's bytes; over parts it is computed incrementally and equals
    the checksum of the joined value."""
    if not isinstance(b, list):
        return xxhash.xxh3_64_intdigest(b)
    if len(b) == 1:
        return xxhash.xxh3_64_intdigest(b[0])
    h = xxhash.xxh3_64()
    for p in b:
        h.update(p)
    return h.intdigest()


def flat_buffers(blocks: Sequence[Block]) -> list[Buffer]:
    """Every block's buffers in order, for one ``sendmsg`` (no copies)."""
    out: list[Buffer] = []
    for b in blocks:
        if isinstance(b, list):
            out.extend(b)
        else:
            out.append(b)
    return out


@dataclass(slots=True, frozen=True)
class Header:
    """A decoded frame header (request or answer)."""

    op: int
    flags_or_code: int
    ns_len: int
    count: int
    req_id: int


def encode_request_header(op: int, ns: bytes, count: int, req_id: int, flags: int = 0) -> bytes:
    """Header followed by the namespace bytes."""
    return HEADER.pack(REQ_MAGIC, op, flags, len(ns), count, req_id) + ns


def encode_answer_header(op: int, code: int, count: int, req_id: int, tag: int = 0) -> bytes:
    """``tag``: the worker's 16-bit arena tag in shm:// answers (0 elsewhere)."""
    return HEADER.pack(ANS_MAGIC, op, code, tag, count, req_id)


@dataclass(frozen=True, slots=True)
class ShmHello:
    """What a worker's hand-over says besides its descriptors."""

    arena_id: str
    size: int
    inbox: int  # bytes of the client's inbox (0: none)
    budget: int  # bytes of withdrawn slots the client's hazard words may hold
    flags: int  # SHM_HAS_INDEX | SHM_HAS_INBOX


def encode_shm_request(identity: bytes, token: str) -> bytes:
    """What a same-host client sends on the hand-over socket."""
    raw = token.encode()
    if len(identity) != IDENTITY or len(raw) > MAX_TOKEN:
        raise ProtocolError("bad shm hand-over request")
    return SHM_REQUEST.pack(SHM_REQ_MAGIC, SHM_VERSION, len(raw), identity) + raw


def decode_shm_request(buf: bytes) -> tuple[int, bytes, int]:
    """(version, identity, token length) of a hand-over request's head; ProtocolError."""
    if len(buf) != SHM_REQUEST.size:
        raise ProtocolError("bad shm hand-over request")
    magic, version, tlen, identity = SHM_REQUEST.unpack(buf)
    if magic != SHM_REQ_MAGIC or tlen > MAX_TOKEN:
        raise ProtocolError("bad shm hand-over request")
    return version, identity, tlen


def encode_shm_hello(arena_id: str, size: int, inbox: int, budget: int, flags: int) -> bytes:
    """The message that carries the descriptors (SCM_RIGHTS) to a same-host client."""
    return SHM_HELLO.pack(SHM_MAGIC, bytes.fromhex(arena_id), size, inbox, budget, flags)


def decode_shm_hello(buf: bytes) -> ShmHello:
    """A hand-over message; ProtocolError when it is not one."""
    if len(buf) != SHM_HELLO.size:
        raise ProtocolError("bad shm hand-over message")
    magic, raw_id, size, inbox, budget, flags = SHM_HELLO.unpack(buf)
    if magic != SHM_MAGIC:
        raise ProtocolError("bad shm hand-over magic")
    return ShmHello(raw_id.hex(), size, inbox, budget, flags)


def decode_header(buf: bytes | bytearray | memoryview, magic: bytes) -> Header:
    """Decode a 20-byte header; ProtocolError on a wrong magic or an out-of-range field."""
    got_magic, op, flags, ns_len, count, req_id = HEADER.unpack(buf)
    if got_magic != magic:
        raise ProtocolError(f"bad frame magic {bytes(got_magic)!r}")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op}")
    return Header(op, flags, ns_len, count, req_id)


def encode_get_entries(
    blocks: Sequence[tuple[memoryview, int] | None],
) -> tuple[bytearray, list[memoryview], int]:
    """The GET answer body for (payload view, checksum) per hash, None for a miss.

    Returns the entries, the payload views to send after them, and their total size.
    """
    meta = bytearray(len(blocks) * GET_ENTRY.size)
    views: list[memoryview] = []
    total = 0
    for i, b in enumerate(blocks):
        if b is None:
            GET_ENTRY.pack_into(meta, i * GET_ENTRY.size, GET_MISS, 0, 0)
        else:
            view, checksum = b
            GET_ENTRY.pack_into(meta, i * GET_ENTRY.size, GET_HIT, len(view), checksum)
            views.append(view)
            total += len(view)
    return meta, views, total


def encode_where(codes: npt.NDArray[np.uint8]) -> bytes:
    """The body of a FLAG_WHERE answer for per-key WHERE_* codes (ABSENT, DRAM, SSD):
    the present bitmap, then the off-DRAM bitmap (bit i LSB first in byte i // 8)."""
    if not len(codes):
        return b""
    present = np.packbits(codes != WHERE_ABSENT, bitorder="little")
    off = np.packbits(codes == WHERE_SSD, bitorder="little")
    return present.tobytes() + off.tobytes()


def decode_where(body: Buffer, count: int) -> npt.NDArray[np.uint8]:
    """Per key a WHERE_* code (ABSENT, DRAM or SSD) from a FLAG_WHERE answer's body
    (2 * ceil(count/8) bytes); ProtocolError for a body of another size."""
    nb = (count + 7) // 8
    if len(body) != 2 * nb:
        raise ProtocolError(f"where answer of {len(body)} bytes for {count} keys")
    if not count:
        return np.zeros(0, dtype=np.uint8)
    bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8).reshape(2, nb), axis=1,
                         count=count, bitorder="little")  # fmt: skip
    out: npt.NDArray[np.uint8] = bits[0] * (WHERE_DRAM + bits[1] * (WHERE_SSD - WHERE_DRAM))
    return out


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly n bytes; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from the socket (releases the GIL while waiting)."""
    got = 0
    n = len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        got += r


def recv_into_parts(sock: socket.socket, parts: Sequence[memoryview]) -> None:
    """Fill every part completely, in order: scattered by ``recvmsg_into`` (no copy,
    no join), one ``recv_into`` per part on TLS sockets."""
    if isinstance(sock, ssl.SSLSocket) or len(parts) == 1:
        for p in parts:
            recv_into_exact(sock, p)
        return
    views = [p for p in parts if p.nbytes]
    i = 0
    while i < len(views):
        got = sock.recvmsg_into(views[i : i + IOV_MAX])[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        while got > 0:  # advance past what landed; a partial part keeps its tail
            head = views[i]
            if got >= head.nbytes:
                got -= head.nbytes
                i += 1
            else:
                views[i] = head[got:]
                got = 0


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop n bytes, using ``scratch`` as the landing buffer."""
    while n > 0:
        step = min(n, len(scratch))
        recv_into_exact(sock, scratch[:step])
        n -= step


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send all buffers with as few ``sendmsg`` calls as the kernel allows, no copies.

    TLS sockets cannot ``sendmsg``: they get one ``sendall`` per buffer instead.
    """
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        sent = sock.sendmsg(batch)
        # Advance past what went out; a partial send leaves a tail of one view.
        while sent > 0:
            head = views[i]
            if sent >= len(head):
                sent -= len(head)
                i += 1
            else:
                views[i] = head[sent:]
                sent = 0
