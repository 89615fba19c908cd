"""The worker's request core: admit a request, check its limits, hold budgets, name put statuses.

Every way into a worker goes through this module — the tcp://, shm:// and ucx://
transfer servers (``worker/transfer/``) and the gRPC Store servicer — so a check
exists once and every entry point applies it the same way:

- :meth:`RequestCore.authenticate` / :meth:`RequestCore.admit`: token -> tenant,
  namespace syntax and ownership (UNAUTHENTICATED, INVALID_ARGUMENT, PERMISSION_DENIED);
- :meth:`RequestCore.check_batch` / :meth:`RequestCore.check_sizes`: batch size
  (``max_batch``) and value size (``max_value_size``) -> INVALID_ARGUMENT;
- :meth:`RequestCore.check_answer`: bytes one GET answer may carry
  (``max_answer_bytes``: a small request repeating one big hash must not make the
  worker copy gigabytes) -> INVALID_ARGUMENT;
- :class:`Budget` / :class:`Holder`: bytes and entries a request may hold between
  frames (shm:// read pins, tcp:// reserve-ahead), bounded per connection, per client
  (its identity, kvstore_client.security; a connection that gave none is a client of
  its own: never the peer's address, which every engine on a host shares) and per worker;
- :func:`put_status`: one wire status per put slot.

No sockets, no asyncio, no store internals beyond its public calls. Import
direction (no cycles): ``kvstore_client`` <- ``worker.requests`` / ``worker.store``
<- ``worker.transfer`` <- ``worker.server``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore_client import wire
from kvstore_client.errors import (
    InvalidArgument,
    QuotaExceeded,
    ResourceExhausted,
    SessionShareFull,
)
from kvstore_client.keys import check_namespace

from ..auth import Tenant, Tenants
from .tiers.blocks import Block


@dataclass(frozen=True, slots=True)
class Limits:
    """Request limits of one worker (config values; see kvstore.config.WorkerConfig)."""

    max_batch: int = wire.MAX_BATCH  # blocks per request
    max_value_size: int = 16 << 20  # bytes per value
    max_answer_bytes: int = 64 << 20  # payload bytes one inline (gRPC) GET answer may carry
    max_transfer_answer_bytes: int = 4 << 30  # payload bytes per transfer-plane GET frame
    reserve_ahead: int = 8 << 20  # declared put bytes reserved before they arrive (tcp/ucx)
    hold_per_connection: int = 256 << 20  # bytes a connection may hold pinned or reserved
    hold_per_client: int = 512 << 20  # ... all connections of one client address
    hold_per_worker: int = 768 << 20  # ... all connections together
    entries_per_connection: int = 1 << 16  # shm entries (pins + reservations) held open
    entries_per_client: int = 1 << 18
    entries_per_worker: int = 1 << 20
    max_open_requests: int = 64  # unreleased shm requests per connection

    @staticmethod
    def for_arena(arena_bytes: int, max_value_size: int, **kw: int) -> Limits:
        """Defaults scaled to the arena: a connection may hold a quarter of it (at least
        two values), a client address half, all clients three quarters; 0 = that default."""
        conn = max(2 * max_value_size, min(arena_bytes // 4, 1 << 30))
        client = max(conn, arena_bytes // 2)
        worker = max(client, arena_bytes * 3 // 4)
        fields = {
            "max_value_size": max_value_size,
            "hold_per_connection": conn,
            "hold_per_client": client,
            "hold_per_worker": worker,
        }
        fields.update({k: v for k, v in kw.items() if v})
        return Limits(**fields)


def account(identity: bytes) -> str:
    """The budget account of a client identity (kvstore_client.security)."""
    return "id:" + identity.hex()


class Budget:
    """Bytes and entries held by requests, per connection, client and worker.

    Thread-safe. A connection gets a :class:`Holder`; what it holds is given back
    when the request ends or, at the latest, when the connection closes.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._cond = threading.Condition()
        self._client_bytes: dict[str, int] = {}
        self._client_entries: dict[str, int] = {}
        # Bytes each client's hazard words hold in the same-host index (slots the worker
        # could not free because the client names them), as the index upkeep last found.
        self._hazard_bytes: dict[str, int] = {}
        self.bytes = 0
        self.entries = 0
        self.refused = 0  # takes that did not fit (also after waiting)

    def holder(self, client: str) -> Holder:
        return Holder(self, client)

    def _fits(self, h: Holder, nbytes: int, entries: int, whole: bool) -> bool:
        lim = self.limits
        # Holding nothing, one value's worth always fits (a request is never refused for
        # the size of a single value), or any amount with ``whole``; beyond that, every
        # bound applies. ``whole`` never lifts the worker's bound: no single request
        # may pin more than hold_per_worker.
        single = nbytes <= lim.max_value_size
        one = whole or single
        if nbytes and h.bytes + nbytes > lim.hold_per_connection and (h.bytes or not one):
            return False
        if entries and h.entries + entries > lim.entries_per_connection:
            return False
        cb = self._client_bytes.get(h.client, 0) + self._hazard_bytes.get(h.client, 0)
        if nbytes and cb + nbytes > lim.hold_per_client and (cb or not one):
            return False
        if entries and self._client_entries.get(h.client, 0) + entries > lim.entries_per_client:
            return False
        if nbytes and self.bytes + nbytes > lim.hold_per_worker and (self.bytes or not single):
            return False
        return not (entries and self.entries + entries > lim.entries_per_worker)

    def client_bytes(self, client: str) -> int:
        """Bytes the client's connections hold now (its hazard holds not included)."""
        with self._cond:
            return self._client_bytes.get(client, 0)

    def set_hazards(self, held: dict[str, int]) -> None:
        """Each client's bytes held through hazard words (the index upkeep's finding; a
        client absent from ``held`` holds none): counted with what its connections
        hold, so one client holds at most hold_per_client either way."""
        with self._cond:
            freed = any(held.get(k, 0) < v for k, v in self._hazard_bytes.items())
            self._hazard_bytes = {k: v for k, v in held.items() if v}
            if freed:
                self._cond.notify_all()

    def take_for(self, h: Holder, nbytes: int, entries: int, wait: float, whole: bool) -> bool:
        """:meth:`Holder.take` (the holder's counts are kept here, under this budget's lock)."""
        deadline = time.monotonic() + wait
        with self._cond:
            while not self._fits(h, nbytes, entries, whole):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    return False
                self._cond.wait(left)
            h.bytes += nbytes
            h.entries += entries
            self._client_bytes[h.client] = self._client_bytes.get(h.client, 0) + nbytes
            self._client_entries[h.client] = self._client_entries.get(h.client, 0) + entries
            self.bytes += nbytes
            self.entries += entries
            return True

    def give_for(self, h: Holder, nbytes: int, entries: int) -> None:
        """:meth:`Holder.give` (at most what ``h`` holds)."""
        nbytes = min(nbytes, h.bytes)
        entries = min(entries, h.entries)
        if not nbytes and not entries:
            return
        with self._cond:
            h.bytes -= nbytes
            h.entries -= entries
            self.bytes -= nbytes
            self.entries -= entries
            for book, n in ((self._client_bytes, nbytes), (self._client_entries, entries)):
                left = book.get(h.client, 0) - n
                if left > 0:
                    book[h.client] = left
                else:
                    book.pop(h.client, None)
            self._cond.notify_all()


class Holder:
    """What one connection holds of a :class:`Budget`."""

    __slots__ = ("budget", "bytes", "client", "entries")

    def __init__(self, budget: Budget, client: str) -> None:
        self.budget = budget
        self.client = client
        self.bytes = 0
        self.entries = 0

    def take(
        self, nbytes: int, entries: int = 0, *, wait: float = 0.0, whole: bool = False
    ) -> bool:
        """Hold ``nbytes`` and ``entries`` more, waiting up to ``wait`` seconds for others to
        give some back; False when they do not fit. A connection holding nothing may always
        take one value's worth, so a single value is never refused for its size alone;
        clients cut shm:// puts into requests of at most two values' worth (which
        always fit the per-connection bound, at least two values). ``whole``: a holder
        holding nothing may take any amount up to the worker's bound (a read's pins: a
        client that releases each read before the next is never refused; one that holds
        reads open is bounded)."""
        return self.budget.take_for(self, nbytes, entries, wait, whole)

    def give(self, nbytes: int, entries: int = 0) -> None:
        self.budget.give_for(self, nbytes, entries)

    def rebind(self, client: str) -> None:
        """Count under another client's account from now on (the connection said who
        it is before holding anything; a holder that holds something stays put)."""
        if not self.bytes and not self.entries:
            self.client = client

    def close(self) -> None:
        """Give back everything (the connection is gone)."""
        self.budget.give_for(self, self.bytes, self.entries)


class RequestCore:
    """Admission and limits shared by every server of one worker."""

    def __init__(self, limits: Limits, tenants: Tenants | None = None) -> None:
        self.limits = limits
        self.tenants = tenants
        self.budget = Budget(limits)

    # ---- who and what ----------------------------------------------------------

    def authenticate(self, token: str | None) -> Tenant | None:
        """The caller's tenant (None when the worker has no tenants); UNAUTHENTICATED."""
        if self.tenants is None:
            return None
        return self.tenants.authenticate(token)

    def admit(self, tenant: Tenant | None, ns: str | bytes | bytearray | memoryview) -> str:
        """A valid namespace the tenant owns; INVALID_ARGUMENT or PERMISSION_DENIED."""
        if not isinstance(ns, str):
            try:
                ns = bytes(ns).decode()
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"bad namespace: {e}") from e
        check_namespace(ns)
        if tenant is not None:
            Tenants.authorize(tenant, ns)
        return ns

    # ---- limits ------------------------------------------------------------------

    def check_batch(self, count: int) -> None:
        if count > self.limits.max_batch:
            raise InvalidArgument(
                f"batch of {count} exceeds the limit of {self.limits.max_batch} blocks"
            )

    def check_sizes(self, sizes: Sequence[int]) -> None:
        limit = self.limits.max_value_size
        for i, size in enumerate(sizes):
            if size > limit:
                raise InvalidArgument(f"value {i} of {size} bytes exceeds the limit of {limit}")

    def check_answer(self, total: int, *, inline: bool) -> None:
        """A GET answer of ``total`` payload bytes (duplicates counted each time)."""
        limit = self.limits.max_answer_bytes if inline else self.limits.max_transfer_answer_bytes
        if total > limit:
            raise InvalidArgument(
                f"the answer would carry {total} bytes, over the limit of {limit}: "
                "ask for fewer blocks per call"
            )


def put_status(slot: Block | ResourceExhausted | None) -> int:
    """The wire status of a put slot that was not written: present, full or over quota."""
    if isinstance(slot, QuotaExceeded):
        return wire.PUT_QUOTA
    if isinstance(slot, SessionShareFull):
        return wire.PUT_DECLINED
    if isinstance(slot, ResourceExhausted):
        return wire.PUT_FULL
    return wire.PUT_PRESENT
