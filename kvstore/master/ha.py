"""High availability: several masters elect a leader in etcd and keep the
membership there, so a new leader takes over without losing it.

One :class:`HaCoordinator` per master runs two tasks:

- **election**: the master keeps an etcd lease alive (TTL ``lease_ttl``, refreshed
  every third of it) and tries to create the leader key on that lease. The one
  that creates it leads until its lease is lost; the others wait for the key to
  vanish (a watch event, or a retry every TTL) and try again. A leader that
  stops cleanly revokes its lease, and a standby leads at once. A leader that
  dies keeps the key until its lease expires (one TTL after its last refresh,
  plus etcd's 0.5 s expiry tick), unless a standby proves it dead sooner: its
  port refuses connections and its lease missed two refreshes; then the standby
  revokes that lease and leads (about 2-4 s after a SIGKILL with the 5 s TTL).
- **mirror**: every master reads the cluster's keys and watches them, keeping a
  read-only copy; standbys publish it as their shard map, so GetShardMap,
  WatchShardMap and ClusterStatus work on any master.

Only the leader writes, and every write is one etcd transaction fenced on the
leader key's create revision: a deposed leader can never overwrite its
successor's state. The leader persists membership changes before it publishes
them, so no client ever sees a map version that a successor could reuse.

The coordinator tells the servicer about role changes through :class:`Listener`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from collections.abc import Awaitable
from typing import Protocol

from .. import metrics
from ..errors import InvalidArgument, Unavailable
from .etcd import MAX_TXN_OPS, EtcdClient, EtcdUnavailable, KeyValue
from .probe import address_refuses
from .snapshot import Layout, Snapshot, decode, decode_leader, diff, encode_leader

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 5.0
PROBE_INTERVAL = 0.5  # how often a standby checks whether the leader's process is gone


class Role(enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"


class Listener(Protocol):
    """What the servicer does when the coordinator's view changes (called on the loop)."""

    async def become_leader(self, snap: Snapshot) -> None:
        """This master now leads; ``snap`` is the state persisted in etcd."""

    async def become_standby(self, snap: Snapshot) -> None:
        """This master stopped leading; ``snap`` is the mirrored state."""

    async def mirror_changed(self, snap: Snapshot) -> None:
        """etcd holds a new map version (sent to standbys only)."""


class HaCoordinator:
    """Leader election and persisted membership for one master; see the module doc."""

    def __init__(
        self,
        etcd: EtcdClient,
        layout: Layout,
        address: str,
        listener: Listener,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
    ) -> None:
        if lease_ttl < 2:
            raise InvalidArgument("the etcd lease TTL must be at least 2s")
        self.etcd = etcd
        self.layout = layout
        self.address = address
        self.listener = listener
        self.lease_ttl = lease_ttl
        self.role = Role.STANDBY
        self.leader_address = ""  # the leader as last seen in etcd; "" while there is none
        self._mirror: dict[bytes, bytes] = {}
        self._mirror_ready = asyncio.Event()
        self._leader_gone = asyncio.Event()
        self._deposed = asyncio.Event()
        self._persisted: dict[bytes, bytes] = {}
        self._fence = 0
        self._write_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._lease = 0
        metrics.MASTER_LEADER.set(0)

    @property
    def is_leader(self) -> bool:
        return self.role is Role.LEADER

    # ---- lifetime ------------------------------------------------------------

    async def start(self, timeout: float = 15.0) -> None:
        """Start the mirror and the election; returns once the state was read from
        etcd. Raises EtcdUnavailable when etcd does not answer within ``timeout``."""
        self._tasks = [
            asyncio.create_task(self._mirror_loop(), name="etcd-mirror"),
            asyncio.create_task(self._election_loop(), name="etcd-election"),
        ]
        try:
            await asyncio.wait_for(self._mirror_ready.wait(), timeout)
        except TimeoutError:
            await self.stop()
            raise EtcdUnavailable(
                f"no answer from etcd at {','.join(self.etcd.endpoints)} within {timeout:.0f}s"
            ) from None

    async def stop(self) -> None:
        """Stop both tasks and revoke the lease, so a standby takes over at once."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        await self._revoke()
        self.role = Role.STANDBY
        metrics.MASTER_LEADER.set(0)

    async def _revoke(self) -> None:
        lease, self._lease = self._lease, 0
        if lease:
            with contextlib.suppress(EtcdUnavailable):
                await self.etcd.revoke(lease)

    # ---- writes (leader) -----------------------------------------------------

    async def persist(self, state: dict[bytes, bytes]) -> None:
        """Write what changed between the last persisted state and ``state`` (from
        :func:`snapshot.encode`), fenced on our leadership.

        Returns once etcd holds ``state``. Raises Unavailable when this master does
        not lead, when etcd cannot be reached (the change stays in memory and goes
        out with the next write), or when the fence fails (then it steps down).
        """
        async with self._write_lock:
            if not self.is_leader:
                raise Unavailable(
                    f"not the leader; the leader is {self.leader_address or 'unknown'}"
                )
            puts, deletes = diff(self._persisted, state, self.layout.version_key)
            ops: list[tuple[bytes, bytes | None]] = [(k, None) for k in deletes]
            ops += [(k, v) for k, v in puts]  # the version key comes last
            for i in range(0, len(ops), MAX_TXN_OPS):
                chunk = ops[i : i + MAX_TXN_OPS]
                ok = await self.etcd.fenced_write(
                    self.layout.leader_key,
                    self._fence,
                    [(k, v) for k, v in chunk if v is not None],
                    [k for k, v in chunk if v is None],
                )
                if not ok:
                    log.error("lost leadership: the leader key changed under us")
                    self._deposed.set()
                    raise Unavailable("this master lost leadership")
                for k, v in chunk:
                    if v is None:
                        self._persisted.pop(k, None)
                    else:
                        self._persisted[k] = v

    # ---- election ------------------------------------------------------------

    async def _election_loop(self) -> None:
        backoff = 0.2
        while True:
            keeper: asyncio.Task[None] | None = None
            try:
                self._lease = await self.etcd.grant(math.ceil(self.lease_ttl))
                keeper = asyncio.create_task(
                    self.etcd.keep_alive(self._lease, self.lease_ttl), name="etcd-lease"
                )
                while not keeper.done():
                    self._leader_gone.clear()
                    won, holder = await self.etcd.create_if_absent(
                        self.layout.leader_key, encode_leader(self.address), self._lease
                    )
                    if won:
                        assert holder is not None
                        await self._lead(holder, keeper)
                        break  # deposed or lease lost: start over with a new lease
                    if holder is not None:
                        self._see_leader(holder.value)
                        await self._wait_for_change(keeper, holder)
                backoff = 0.2
            except EtcdUnavailable as e:
                log.warning("election: %s", e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug: keep campaigning rather than never lead again
                log.exception("election failed")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                if keeper is not None:
                    keeper.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await keeper
                await self._revoke()

    async def _wait_for_change(self, keeper: asyncio.Task[None], holder: KeyValue) -> None:
        """Stand by until the leader key vanishes, our lease is lost or a TTL passed.

        Meanwhile probe the leader: when its port refuses connections (its process
        is gone) and its lease has missed two refreshes, revoke that lease instead
        of waiting for it to expire. Both conditions are needed, so a leader that is
        alive but slow, or unreachable from here only, is never deposed this way;
        and a wrongly deposed leader is only a needless election, never two leaders
        writing (every write is fenced).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_ttl
        while loop.time() < deadline:
            await _first(keeper, self._leader_gone.wait(), timeout=PROBE_INTERVAL)
            if keeper.done() or self._leader_gone.is_set():
                return
            if holder.lease and await self._leader_dead(holder):
                log.warning("leader %s is gone: revoking its lease", decode_leader(holder.value))
                with contextlib.suppress(EtcdUnavailable):
                    await self.etcd.revoke(holder.lease)
                return

    async def _leader_dead(self, holder: KeyValue) -> bool:
        if not await address_refuses(decode_leader(holder.value)):
            return False
        left = await self.etcd.time_to_live(holder.lease)
        # A live leader refreshes every TTL/3, so it always has more than TTL/3 left.
        return left is not None and left < self.lease_ttl / 3

    async def _lead(self, key: KeyValue, keeper: asyncio.Task[None]) -> None:
        """Lead until the lease is lost or a fenced write fails."""
        _, kvs = await self.etcd.get_prefix(self.layout.prefix)  # the state as of our win
        self._persisted = {kv.key: kv.value for kv in kvs if self.layout.is_state_key(kv.key)}
        self._fence = key.create_revision
        self._deposed.clear()
        self.role = Role.LEADER
        self.leader_address = self.address
        metrics.MASTER_LEADER.set(1)
        metrics.LEADER_TERMS.inc()
        snap = decode(self.layout, self._persisted)
        log.warning(
            "leading cluster %s: %d workers, map v%d",
            self.layout.cluster,
            len(snap.workers),
            snap.version,
        )
        try:
            await self.listener.become_leader(snap)
            await _first(keeper, self._deposed.wait())
        finally:
            async with self._write_lock:
                self.role = Role.STANDBY
                self.leader_address = ""
                metrics.MASTER_LEADER.set(0)
            log.warning("stepped down as leader of cluster %s", self.layout.cluster)
            await self.listener.become_standby(decode(self.layout, self._mirror))

    def _see_leader(self, value: bytes | None) -> None:
        if value is None:
            if not self.is_leader:
                self.leader_address = ""
            self._leader_gone.set()
        elif not self.is_leader:
            self.leader_address = decode_leader(value)

    # ---- mirror --------------------------------------------------------------

    async def _mirror_loop(self) -> None:
        backoff = 0.2
        while True:
            try:
                rev, kvs = await self.etcd.get_prefix(self.layout.prefix)
                self._mirror = {kv.key: kv.value for kv in kvs if self.layout.is_state_key(kv.key)}
                leader = next((kv for kv in kvs if kv.key == self.layout.leader_key), None)
                self._see_leader(leader.value if leader else None)
                await self._publish_mirror()
                self._mirror_ready.set()
                backoff = 0.2
                async for events in self.etcd.watch(self.layout.prefix, rev + 1):
                    new_version = False
                    for ev in events:
                        if ev.key == self.layout.leader_key:
                            self._see_leader(None if ev.deleted else ev.value)
                        elif self.layout.is_state_key(ev.key):
                            if ev.deleted:
                                self._mirror.pop(ev.key, None)
                            else:
                                self._mirror[ev.key] = ev.value
                            new_version |= ev.key == self.layout.version_key
                    if new_version:
                        await self._publish_mirror()
            except EtcdUnavailable as e:
                log.warning("mirror: %s", e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug: keep mirroring rather than serve a frozen map
                log.exception("mirror failed")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _publish_mirror(self) -> None:
        if not self.is_leader:
            await self.listener.mirror_changed(decode(self.layout, self._mirror))

    def mirror_snapshot(self) -> Snapshot:
        """The state as last read from etcd."""
        return decode(self.layout, self._mirror)


async def _first(
    task: asyncio.Task[None], other: Awaitable[object], timeout: float | None = None
) -> None:
    """Wait until ``task`` ends, the awaitable ``other`` completes, or ``timeout``."""
    waiter = asyncio.ensure_future(other)
    try:
        await asyncio.wait([task, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
