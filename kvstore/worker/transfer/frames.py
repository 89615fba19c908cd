"""The one frame core of the transfer plane: every check a frame goes through and the
bookkeeping of what it does, for every transport, with no I/O.

The transports (``tcp.py``, ``ucx.py``; ``shm.py`` is served over tcp://) read bytes,
hand them here, and move bytes as they are told: a :class:`PutPlan` says where each
PUT payload lands (an arena slot, or nowhere), a :class:`GetAnswer` lists the
buffers a GET answer is made of. Nothing here touches a socket or an event loop, so
the decisions are unit-tested with frames in and decisions out.

One order of checks for every frame, on every transport (cheapest first, and every
check that bounds what is read comes before the read):

1. the header: magic and op (:func:`wire.decode_header`; ProtocolError, no answer);
2. AUTH: with tenants, the first frame must be AUTH with a token of at most
   ``wire.MAX_TOKEN`` bytes (UNAUTHENTICATED, answered); without, AUTH is accepted
   (any token) only as the first frame (ProtocolError, no answer);
3. the namespace length, 1..255 (ProtocolError, no answer);
4. the op is served by this transport (INVALID_ARGUMENT, answered);
5. the flags are known for the op on this transport, and not a combination it refuses
   (EXISTS: FLAG_PREFIX or FLAG_WHERE, not both) (INVALID_ARGUMENT, answered);
6. the batch size, ``count <= max_batch`` (INVALID_ARGUMENT, answered);
7. then the namespace is read and admitted: syntax and the tenant's ownership
   (INVALID_ARGUMENT or PERMISSION_DENIED, answered); RELEASE skips this (it names
   only what its own connection holds);
8. then the body is read (its length follows from the header: :meth:`FrameCore.body_len`)
   and checked by the op: value sizes, part tables, answer sizes.

A refusal that is answered raises :class:`Refused` (the transport sends
:meth:`Refused.answer`, then closes); one that is not raises ProtocolError (the
transport closes). Either way the frame is counted in ``bad_frames``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import xxhash

from kvstore_client import verified, wire
from kvstore_client.errors import (
    InvalidArgument,
    KVStoreError,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
    to_grpc_code,
)
from kvstore_client.keys import HASH_LEN, split_hashes, to_bitmap
from kvstore_client.transport.ucxcodec import ERROR_MAX, read_part_counts, slices, split_sizes
from kvstore_client.verified import VERIFY_LATER

from ...auth import Tenant, Tenants
from ..requests import Holder, Limits, RequestCore, account, put_status
from ..store import BlockStore
from ..tiers.blocks import Block

# The ops each transport serves, with the request flags each op may carry.
TCP_OPS: Mapping[int, int] = {
    wire.OP_PUT: wire.FLAG_SESSION,
    wire.OP_GET: 0,
    wire.OP_EXISTS: wire.FLAG_PREFIX | wire.FLAG_WHERE,
    wire.OP_REMOVE: 0,
    wire.OP_GET_LOC: 0,
    wire.OP_RELEASE: 0,
    wire.OP_PUT_INBOX: wire.FLAG_SESSION,
}
UCX_OPS: Mapping[int, int] = {
    wire.OP_PUT: wire.FLAG_PARTS | wire.FLAG_SESSION | wire.FLAG_PACKED,
    wire.OP_GET: wire.FLAG_PARTS | wire.FLAG_PACKED,
    wire.OP_EXISTS: wire.FLAG_PREFIX | wire.FLAG_WHERE,
    wire.OP_REMOVE: 0,
}
# Flags an op may carry one at a time, not together (INVALID_ARGUMENT).
EXCLUSIVE: Mapping[int, int] = {wire.OP_EXISTS: wire.FLAG_PREFIX | wire.FLAG_WHERE}

# Operation names for kvstore_requests_total{op} (a small fixed set).
OP_NAMES = {
    wire.OP_PUT: "put",
    wire.OP_GET: "get",
    wire.OP_EXISTS: "exists",
    wire.OP_REMOVE: "remove",
    wire.OP_GET_LOC: "shm_get",
    wire.OP_PUT_INBOX: "shm_put",
    wire.OP_RELEASE: "shm_release",  # not counted (one-way, between reads)
}

Buffers = list[bytes | bytearray | memoryview]


class Refused(ProtocolError):
    """A frame refused with an error answer: send :meth:`answer`, then close."""

    def __init__(self, h: wire.Header, error: KVStoreError) -> None:
        super().__init__(str(error))
        self.header = h
        self.error = error

    def answer(self) -> Buffers:
        """The error answer: a header with the error's code, then its message."""
        msg = str(self.error).encode()[:ERROR_MAX]
        h = self.header
        return [wire.encode_answer_header(h.op, int(self.error.code), len(msg), h.req_id), msg]


@contextlib.contextmanager
def refusing(h: wire.Header) -> Iterator[None]:
    """Turn a KVStoreError raised inside into a :class:`Refused` answer for ``h``."""
    try:
        yield
    except ProtocolError:
        raise
    except KVStoreError as e:
        raise Refused(h, e) from e


@contextlib.contextmanager
def observe_frame(on_request: Callable[[str, str, float], None] | None, op: int) -> Iterator[None]:
    """Time the frame served inside the block and report (op, status code, seconds):
    OK, the error's gRPC code (a refusal's own), or UNAVAILABLE when the connection
    broke mid-frame."""
    t0 = time.perf_counter()
    code = "OK"
    try:
        yield
    except Refused as e:
        code = to_grpc_code(e.error).name
        raise
    except KVStoreError as e:
        code = to_grpc_code(e).name
        raise
    except BaseException:
        code = "UNAVAILABLE"
        raise
    finally:
        if on_request is not None:
            on_request(OP_NAMES.get(op, "other"), code, time.perf_counter() - t0)


@dataclass(slots=True)
class Peer:
    """One connection (or endpoint) as the core sees it: who it is and what it holds."""

    holder: Holder
    tenant: Tenant | None = None
    authed: bool = False  # AUTH answered OK
    frames: int = 0  # headers seen
    identity: bytes = b""  # the client's, from AUTH with FLAG_IDENTITY (else none)


def ok_answer(h: wire.Header, count: int = 0, tag: int = 0) -> bytes:
    return wire.encode_answer_header(h.op, 0, count, h.req_id, tag)


def own_core(store: BlockStore, core: RequestCore | None, tenants: Tenants | None) -> RequestCore:
    """``core`` (a worker's one request core, which carries its tenants), or for a
    server built alone a core of ``store``'s defaults with ``tenants``. Tenants given
    with a core would be ignored: refused (InvalidArgument)."""
    if core is not None:
        if tenants is not None:
            raise InvalidArgument("tenants come with the request core: pass one or the other")
        return core
    return RequestCore(Limits.for_arena(store.tier.capacity, store.max_value_size), tenants)


class FrameCore:
    """Checks and bookkeeping of one transport's frames against a BlockStore.

    ``ops``: the ops the transport serves and the flags each may carry
    (:data:`TCP_OPS`, :data:`UCX_OPS`). ``scheme``: its name in messages. Thread-safe
    (the store and the request core are); per-connection state lives in :class:`Peer`.
    """

    def __init__(
        self, store: BlockStore, core: RequestCore, ops: Mapping[int, int], scheme: str
    ) -> None:
        self.store = store
        self.core = core
        self.ops = ops
        self.scheme = scheme

    def peer(self, client: str) -> Peer:
        """A new connection, ``client`` naming it (its budget account until an AUTH
        with the client's identity moves it to the identity's: a client's connections
        share one account, never the peer's address, see kvstore_client.security)."""
        return Peer(self.core.budget.holder(client))

    # ---- the header: checks 1-6 ----------------------------------------------------

    def header(self, p: Peer, head: bytes | bytearray | memoryview) -> wire.Header:
        """Decode and check a request header (steps 1-6 of the module's order). An AUTH
        header comes back for the caller to read its token (``count`` bytes) and hand
        it to :meth:`authenticate`."""
        h = wire.decode_header(head, wire.REQ_MAGIC)
        first = p.frames == 0
        p.frames += 1
        if self.core.tenants is not None and not p.authed:
            if h.op != wire.OP_AUTH or h.count > wire.MAX_TOKEN:
                raise Refused(h, Unauthenticated("the first frame must be AUTH with a token"))
            return h
        if h.op == wire.OP_AUTH:
            if not first or h.count > wire.MAX_TOKEN:
                raise ProtocolError("AUTH is only valid as the first frame")
            return h
        if h.ns_len == 0 or h.ns_len > 255:
            raise ProtocolError(f"namespace length {h.ns_len} out of range")
        allowed = self.ops.get(h.op)
        if allowed is None:
            raise Refused(h, InvalidArgument(f"op {h.op} is not served over {self.scheme}://"))
        if h.flags_or_code & ~allowed:
            name = OP_NAMES.get(h.op, str(h.op)).upper()
            raise Refused(h, InvalidArgument(f"unknown {name} flags {h.flags_or_code:#x}"))
        one_of = EXCLUSIVE.get(h.op, 0)
        if (h.flags_or_code & one_of).bit_count() > 1:
            name = OP_NAMES.get(h.op, str(h.op)).upper()
            raise Refused(h, InvalidArgument(f"{name} flags {h.flags_or_code:#x} go one at a time"))
        with refusing(h):
            self.core.check_batch(h.count)
        return h

    def authenticate(self, p: Peer, h: wire.Header, token: bytes | bytearray) -> bytes:
        """The answer to an AUTH frame whose body was read; UNAUTHENTICATED (Refused)
        for an unknown token. Without tenants any token is accepted. With
        FLAG_IDENTITY the body starts with the client's identity: what this
        connection holds counts from now on with that client's other holdings."""
        if h.flags_or_code & ~wire.FLAG_IDENTITY:
            raise Refused(h, InvalidArgument(f"unknown AUTH flags {h.flags_or_code:#x}"))
        if h.flags_or_code & wire.FLAG_IDENTITY:
            if len(token) < wire.IDENTITY:
                raise Refused(h, InvalidArgument("AUTH with FLAG_IDENTITY is too short"))
            p.identity = bytes(token[: wire.IDENTITY])
            token = token[wire.IDENTITY :]
            p.holder.rebind(account(p.identity))
        if self.core.tenants is not None:
            with refusing(h):
                p.tenant = self.core.tenants.authenticate(bytes(token).decode(errors="replace"))
        p.authed = True
        return ok_answer(h)

    # ---- the namespace and the body: steps 7-8 -------------------------------------

    def admit(self, p: Peer, h: wire.Header, ns: bytes | bytearray | memoryview) -> str:
        """The frame's namespace, valid and owned by the peer's tenant (Refused)."""
        with refusing(h):
            return self.core.admit(p.tenant, ns)

    @staticmethod
    def body_len(h: wire.Header) -> int:
        """Bytes of a checked request's body after its namespace, up to its payloads
        (PUT) or part-size table (FLAG_PARTS)."""
        n = h.count
        if h.op == wire.OP_PUT:
            size = n * wire.PUT_ENTRY.size
        elif h.op == wire.OP_PUT_INBOX:
            return n * wire.INBOX_ENTRY.size
        elif h.op == wire.OP_RELEASE:
            return 0
        else:  # GET, EXISTS, REMOVE, GET_LOC: the hashes
            size = n * HASH_LEN
        if h.op in (wire.OP_PUT, wire.OP_GET) and h.flags_or_code & wire.FLAG_PARTS:
            size += n * wire.PART_COUNT.size
        return size

    @staticmethod
    def part_counts(h: wire.Header, body: memoryview) -> tuple[memoryview, list[int], int]:
        """A FLAG_PARTS body cut into (entries or hashes, part count per block, bytes
        of the part-size table that follows); ProtocolError for a count of 0, over
        wire.MAX_PARTS, or too many parts in all (the codec of
        :mod:`kvstore_client.transport.ucx`)."""
        cut = len(body) - wire.PART_COUNT.size * h.count
        counts = read_part_counts(body[cut:])
        return body[:cut], counts, wire.PART_COUNT.size * sum(counts)

    @staticmethod
    def part_sizes(counts: Sequence[int], table: bytes | bytearray) -> list[list[int]]:
        """Per block the sizes of its parts, from the part-size table."""
        return split_sizes(counts, table)

    # ---- answers -------------------------------------------------------------------

    def exists(self, h: wire.Header, ns: str, body: bytes | bytearray | memoryview) -> Buffers:
        """EXISTS: a bitmap of the keys present; with FLAG_PREFIX only the length of
        their leading run (the lookup stops at the first miss), in the header's count
        and marked TAG_RUN; with FLAG_WHERE two bitmaps in one buffer (present, then
        off DRAM; one message on ucx://), marked TAG_WHERE."""
        keys = split_hashes(body)
        if h.flags_or_code & wire.FLAG_PREFIX:
            run = self.store.match_prefix(ns, keys)
            return [ok_answer(h, run, wire.TAG_RUN)]
        if h.flags_or_code & wire.FLAG_WHERE:
            codes = self.store.where(ns, keys)
            return [ok_answer(h, h.count, wire.TAG_WHERE), wire.encode_where(codes)]
        return [ok_answer(h, h.count), to_bitmap(self.store.exists(ns, keys))]

    def remove(self, h: wire.Header, ns: str, body: bytes | bytearray | memoryview) -> Buffers:
        """REMOVE: the count of keys that were present."""
        return [ok_answer(h, self.store.remove(ns, split_hashes(body)))]

    def put_plan(
        self,
        p: Peer,
        h: wire.Header,
        ns: str,
        entries: bytes | bytearray | memoryview,
        parts: list[list[int]] | None = None,
    ) -> PutPlan:
        """The plan of a PUT whose entries were read; INVALID_ARGUMENT (Refused) for a
        value over the size limit or part sizes that do not add up to their block."""
        got = list(wire.PUT_ENTRY.iter_unpack(entries))
        with refusing(h):
            self.core.check_sizes([e[1] for e in got])
            if parts is not None and any(sum(q) != e[1] for q, e in zip(parts, got, strict=True)):
                raise InvalidArgument("part sizes do not add up to their block's size")
            if h.flags_or_code & wire.FLAG_PACKED:
                if h.flags_or_code & wire.FLAG_PARTS:
                    raise InvalidArgument("a packed PUT has no part tables")
                if sum(e[1] for e in got) > wire.MAX_PACKED:
                    raise InvalidArgument(f"a packed PUT carries at most {wire.MAX_PACKED} bytes")
        return PutPlan(self, p.holder, h, ns, got)

    def get_answer(
        self,
        h: wire.Header,
        ns: str,
        body: bytes | bytearray | memoryview,
        parts: list[list[int]] | None = None,
    ) -> GetAnswer:
        """The answer of a GET whose hashes were read (pins what it sends until
        :meth:`GetAnswer.close`); INVALID_ARGUMENT (Refused) for an answer over
        ``max_transfer_answer_bytes``. With FLAG_PACKED and hits of at most
        wire.MAX_PACKED bytes the answer is :attr:`GetAnswer.packed` (TAG_PACKED): the
        transport sends the payload views as one message."""
        return GetAnswer(self, h, ns, split_hashes(body), parts)


class PutPlan:
    """A PUT's bookkeeping; the transport moves bytes where it says.

    The transport reserves a run of blocks (:meth:`reserve`: a destination per block,
    None for one whose bytes it must read and drop), lands their bytes, reports
    each landed block (:meth:`landed`, or all at once with :meth:`finish`), and sends
    :meth:`answer` once every block is done. :meth:`abort` when the sender vanished:
    the blocks whose bytes did not all arrive never become visible.
    """

    def __init__(
        self,
        frames: FrameCore,
        holder: Holder,
        h: wire.Header,
        ns: str,
        entries: list[tuple[bytes, int, int]],
    ) -> None:
        self.frames = frames
        self.store = frames.store
        self.holder = holder
        self.h = h
        self.ns = ns
        self.entries = entries
        self.sizes = [e[1] for e in entries]
        self.status = bytearray(h.count)
        self.next = 0  # first block not yet reserved
        self.total = 0  # payload bytes of the blocks reserved so far (stored or not)
        self._start = 0
        self._slots: list[Block | ResourceExhausted | None] = []
        self._ok: list[bool | None] = []
        self._later: dict[int, Future[bool]] = {}  # checks running on the copy pool
        self._held = 0

    @property
    def done(self) -> bool:
        return self.next >= len(self.entries)

    def cut(self, limit: int) -> int:
        """End of the next run: at least one block, then blocks while their sizes add
        up to at most ``limit`` bytes."""
        start = self.next
        end, ahead = start + 1, self.sizes[start]
        while end < len(self.sizes) and ahead + self.sizes[end] <= limit:
            ahead += self.sizes[end]
            end += 1
        return end

    def reserve(self, end: int, *, wait: float = 0.0) -> list[memoryview | None]:
        """Reserve blocks ``next..end`` within the peer's budget (waiting up to ``wait``
        seconds for room; over it every block of the run is answered full): per block
        its slot's view, or None where its bytes are to be read and dropped."""
        start = self.next
        run = self.entries[start:end]
        nbytes = sum(self.sizes[start:end])
        slots: list[Block | ResourceExhausted | None]
        if self.holder.take(nbytes, wait=wait):
            self._held = nbytes
            slots = self.store.reserve_many(
                self.ns,
                [e[0] for e in run],
                [e[1] for e in run],
                [e[2] for e in run],
                hinted=bool(self.h.flags_or_code & wire.FLAG_SESSION),
            )
        else:
            slots = [ResourceExhausted("transfer budget exhausted")] * len(run)
        self._start, self._slots, self.next = start, slots, end
        self._ok = [None] * len(run)
        self.total += nbytes
        out: list[memoryview | None] = []
        for i, s in enumerate(slots):
            if isinstance(s, Block):
                out.append(self.store.view(s))
            else:
                out.append(None)
                self.status[start + i] = put_status(s)
        return out

    def landed(self, i: int, view: memoryview) -> None:
        """Block ``i`` (of the run) has all its bytes in ``view``: check its checksum
        (a big block on the copy pool, while the next one arrives; :meth:`finish`
        waits for the check before anything is published)."""
        want = self.entries[self._start + i][2]
        if view.nbytes >= VERIFY_LATER:
            self._later[i] = verified.later(partial(_sum_is, view, want))
            return
        self._checked(i, xxhash.xxh3_64_intdigest(view) == want)

    def _checked(self, i: int, good: bool) -> None:
        self._ok[i] = good
        self.status[self._start + i] = wire.PUT_STORED if good else wire.PUT_CORRUPT
        if not good:
            self.store.counters.checksum_errors += 1

    def finish(self) -> None:
        """Every block of the run is in: check the ones not reported yet, make the
        good ones visible, give the budget back."""
        blocks: list[Block] = []
        ok: list[bool] = []
        later, self._later = self._later, {}
        for i, fut in later.items():
            self._checked(i, fut.result())
        for i, s in enumerate(self._slots):
            if isinstance(s, Block):
                if self._ok[i] is None:
                    self.landed(i, self.store.view(s))
                blocks.append(s)
                ok.append(bool(self._ok[i]))
        self._slots = []
        self.store.finish_many(blocks, ok)
        self.holder.give(self._held)
        self._held = 0

    def abort(self) -> None:
        """The sender vanished mid-run: its reserved blocks are dropped."""
        for fut in self._later.values():  # no check may still read a slot given back
            fut.result()
        self._later = {}
        blocks = [s for s in self._slots if isinstance(s, Block)]
        self._slots = []
        self.store.finish_many(blocks, [False] * len(blocks))
        self.holder.give(self._held)
        self._held = 0

    def answer(self) -> Buffers:
        return [ok_answer(self.h, self.h.count), self.status]


def _sum_is(view: memoryview, want: int) -> bool:
    return xxhash.xxh3_64_intdigest(view) == want


class GetAnswer:
    """A GET's answer: :attr:`buffers` to send (header, entries, payload views) and
    :attr:`nbytes` of payload; :attr:`packed`: the payload views go as one message.
    The views are pinned until :meth:`close`, which the transport calls once the send
    (or the packing copy) is done or abandoned."""

    def __init__(
        self,
        frames: FrameCore,
        h: wire.Header,
        ns: str,
        keys: list[bytes],
        parts: list[list[int]] | None,
    ) -> None:
        store = frames.store
        self._store = store
        # DRAM blocks are verified by the reader against the checksum sent with them.
        self._reading = store.read(ns, keys, verify_dram=False)
        try:
            with refusing(h):
                frames.core.check_answer(self._reading.payload_bytes, inline=False)
        except BaseException:
            store.done(self._reading)
            raise
        held = self._reading.held
        meta, views, self.nbytes = wire.encode_get_entries(
            [(x.view, x.checksum) if x is not None else None for x in held]
        )
        self.packed = bool(h.flags_or_code & wire.FLAG_PACKED) and self.nbytes <= wire.MAX_PACKED
        if self.packed:  # the hits back to back in one message: no part slicing
            self.buffers: Buffers = [ok_answer(h, h.count, wire.TAG_PACKED), meta, *views]
            return
        if parts is not None:  # a hit of the reader's part sizes goes out one view a part
            views = []
            for x, q in zip(held, parts, strict=True):
                if x is None:
                    continue
                v = memoryview(x.view).cast("B")
                views.extend(slices(v, q) if len(q) > 1 and sum(q) == v.nbytes else [v])
        self.buffers = [ok_answer(h, h.count), meta, *views]

    def close(self) -> None:
        self._store.done(self._reading)
