"""Cluster membership and the shard map, as a state machine without I/O.

Events in (register, bind, beat, update, leave, tick with the current time and how
late the tick ran), state out (the map and its version, what a tick decided). Every
change that clients must see bumps ``version``; the servicer pushes the new map to
watchers.

A registration is bound to the worker's *instance token* (random, made by each
worker process at start). While a registration lives, a register, bind, heartbeat or
leave for its id with another token raises :class:`IdConflict` and changes
nothing: a second process started with the same ``--id``, or anyone on the
network with tokens off, can neither take over a live worker's id (and so its
traffic) nor drop it from the map. Once the id expired or left, any instance
may register it again (a restarted worker waits at most one TTL). The servicer
also lets a new instance in at once when it proves the old one gone (the old
registration's gRPC port refuses connections; :meth:`evict`).

**Liveness is judged on what arrived.** A worker is expired for silence the master
could have heard, not for beats it did not get to read:

- *Deaf time.* Each :meth:`~Membership.tick` says how late it ran. Lateness beyond a
  small tolerance means the master (its event loop, or its host) was behind: beats
  may be waiting unread. That time is not counted as anyone's silence: silence runs
  on a *listening clock*, wall time minus the deaf time.
- *Mass silence.* When more than ``storm_fraction`` of the members (and at least
  ``storm_min``) are silent at once (past the TTL, or quiet for STORM_ONSET_TTLS of
  it while the first is past it), the trouble is more likely the
  master's or the network's than theirs: they are held, not expired, for HOLD_TTLS
  more TTLs (the tick reports them, the servicer alerts).
- *Backoff.* A master that is behind because of its own work (deaf for more than
  SHED_DEAF_TTLS of the last TTL while it used more than SHED_BUSY of a core) asks
  the workers to beat less often (:attr:`~Membership.pace` doubles, up to
  ``max_pace``), and stretches the TTL by as much before any worker slows down.
  A master that is merely starved by its neighbours (late, but not busy) does not
  shed: fewer heartbeats would not give it the CPU back, and the deaf time already
  keeps its lateness from expiring anyone. The pace halves again after a TTL
  without cause, and the longer TTL stays one more TTL, until every worker heard of
  the shorter interval.
- *A first beat is due later.* A worker beats only once it has read its Register
  answer, which the master cannot see arrive: on a busy host (`kvstore bench scale
  --background-load 8`) the answers reached the workers up to 4-13 s after the master
  read the Register (the worst of 1,000). Until its first beat after a registration a
  member has REGISTER_GRACE_TTLS more TTLs of silence, so only the hard limit below
  (4 TTLs of wall time) drops a registration that never beat.
- A worker silent for MAX_SILENCE_TTLS TTLs of wall time is expired whatever the
  deaf time, the storm or a new leader's grace, so a master that is behind for ever
  still drops the dead.

Beats by slot (the Beats protocol) cost no map work: :meth:`~Membership.bind` once
per stream, then :meth:`~Membership.beat_all` sets two numbers per member.

Registrations are checked against size limits (:func:`check_worker`), and the
number of members is capped, so the map every client downloads stays small. A
registered capacity above ``MAX_CAPACITY`` is refused; one that the ring bounds
(:func:`kvstore_client.sharding.point_counts`: a share of the ring, the ring's
total) is accepted and :meth:`Membership.ring_note` says how it is counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore_client.errors import (
    Code,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ResourceExhausted,
)
from kvstore_client.proto import master_pb2
from kvstore_client.sharding import (
    DEFAULT_VNODES_PER_GIB,
    MAX_RING_POINTS,
    MAX_WORKER_SHARE,
    MIN_VNODES,
    bound_counts,
    share_cap,
    vnode_count,
    wanted_counts,
)

# Size limits of one registration (bytes of UTF-8); see master.proto.
MAX_ID = 128
MAX_GRPC = 256
MAX_ENDPOINTS = 8
MAX_ENDPOINT = 256
MAX_HOST_ID = 128
MAX_VERSION = 64
MIN_INSTANCE = 16
MAX_INSTANCE = 128
MAX_WORKERS = 1024  # at <= 2.7 KiB per worker, the map stays under gRPC's 4 MiB default
MAX_CAPACITY = 1 << 50  # bytes of DRAM one worker may register (1 PiB: no host has it)

# Liveness (see the module doc). Fractions of the TTL unless said otherwise.
LAG_TOLERANCE_TTLS = 0.02  # a tick later than this: the excess is deaf time
STORM_FRACTION = 0.1  # more members than this silent at once: held, not expired
STORM_MIN = 3
STORM_ONSET_TTLS = 0.5  # quiet this long (beats come every TTL/4): counted in a storm
HOLD_TTLS = 2.0  # held members expire after this many more TTLs of silence
MAX_SILENCE_TTLS = 4.0  # ... and anyone after this many TTLs of wall-clock silence
REGISTER_GRACE_TTLS = 3.0  # more silence allowed a registration until its first beat
SHED_DEAF_TTLS = 0.25  # deaf for more than this within a TTL ...
SHED_BUSY = 0.5  # ... while using more than this of a core: ask workers to slow down
MAX_PACE = 4.0  # the longest interval asked is MAX_PACE x the base interval


class IdConflict(KVStoreError):
    """A worker id is live and bound to another instance token (FAILED_PRECONDITION).

    ``live_at``: the holder's gRPC address when the master saw it accept a connection
    there (a different address than the caller's): the id is provably taken."""

    code = Code.FAILED_PRECONDITION
    live_at: str = ""


def _printable(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _check_len(what: str, text: str, limit: int) -> None:
    n = len(text.encode())
    if n > limit:
        raise InvalidArgument(f"worker {what} of {n} bytes exceeds the limit of {limit}")


def check_instance(token: str) -> None:
    """InvalidArgument unless ``token`` is a plausible instance token."""
    if not MIN_INSTANCE <= len(token) <= MAX_INSTANCE or not _printable(token):
        raise InvalidArgument(
            f"the instance token must be {MIN_INSTANCE}..{MAX_INSTANCE} printable ASCII "
            "characters (workers of this version send one)"
        )


def check_worker(info: master_pb2.WorkerInfo) -> None:
    """InvalidArgument unless ``info`` is complete and within the size limits."""
    if not info.id or not info.grpc or not info.endpoints or not info.capacity_bytes:
        raise InvalidArgument("worker registration needs id, grpc, endpoints and capacity")
    if info.capacity_bytes > MAX_CAPACITY:
        raise InvalidArgument(
            f"worker capacity of {info.capacity_bytes} bytes exceeds the limit of "
            f"{MAX_CAPACITY} (1 PiB)"
        )
    _check_len("id", info.id, MAX_ID)
    if not _printable(info.id):
        raise InvalidArgument("worker id must be printable ASCII")
    _check_len("grpc address", info.grpc, MAX_GRPC)
    if len(info.endpoints) > MAX_ENDPOINTS:
        raise InvalidArgument(
            f"{len(info.endpoints)} endpoints exceed the limit of {MAX_ENDPOINTS}"
        )
    for ep in info.endpoints:
        _check_len("endpoint URL", ep, MAX_ENDPOINT)
    _check_len("host_id", info.host_id, MAX_HOST_ID)
    _check_len("version", info.version, MAX_VERSION)


@dataclass(slots=True, eq=False)
class Member:
    """One registration. ``heard``: when the master last heard from it, on the
    listening clock (:meth:`Membership.listening`); ``seen``: the same in wall time."""

    info: master_pb2.WorkerInfo
    heard: float
    stats: master_pb2.WorkerStats = field(default_factory=master_pb2.WorkerStats)
    draining: bool = False
    instance: str = ""  # "" only for state persisted by an older master: bound on next contact
    seen: float = float("nan")  # wall time of the last contact (nan: as ``heard``)
    grace: float = 0.0  # more silence allowed until the first beat after registering

    def __post_init__(self) -> None:
        if self.seen != self.seen:
            self.seen = self.heard


@dataclass(frozen=True, slots=True)
class Tick:
    """What one :meth:`Membership.tick` decided."""

    expired: list[str]  # removed for silence
    held: int  # silent past the TTL, kept because the master may be the one at fault
    deaf: float  # seconds of this tick's lateness counted as deaf time
    pace: float  # the interval multiplier the workers are asked for now
    overloaded: bool  # deaf within the last TTL, holding members, or asking for backoff
    # per expired member, why: its silence on the listening clock and in wall time
    why: list[str] = field(default_factory=list)


class Membership:
    """Workers that joined and still heartbeat within ``ttl`` seconds (see the module
    doc for how silence is judged). Times are seconds on one monotonic clock."""

    def __init__(
        self,
        ttl: float,
        *,
        replicas: int = 1,
        cluster_id: str = "kvstore",
        vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB,
        max_workers: int = MAX_WORKERS,
        storm_fraction: float = STORM_FRACTION,
        storm_min: int = STORM_MIN,
        max_pace: float = MAX_PACE,
    ) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.ttl = ttl
        self.replicas = replicas
        self.vnodes_per_gib = vnodes_per_gib
        self.cluster_id = cluster_id
        self.max_workers = max_workers
        self.storm_fraction = storm_fraction
        self.storm_min = storm_min
        self.max_pace = max(1.0, max_pace)
        self.members: dict[str, Member] = {}
        self.version = 1
        self._scale_noted = False  # ring_note said the ring is scaled down
        self.beats = 0  # heartbeats applied (a bind, beat or update each), for the metrics
        self.deaf = 0.0  # seconds not counted as anyone's silence (the master was behind)
        self.pace = 1.0
        self._ttl_pace = 1.0  # the pace the TTL is stretched by (see _set_pace)
        self._ttl_pace_until = -float("inf")  # ... until then (wall time), after a lower pace
        self._pace_at = -float("inf")  # wall time of the last pace change
        self._deaf_log: deque[tuple[float, float]] = deque()  # (wall time, excess), last TTL
        self._busy_log: deque[tuple[float, float]] = deque()  # (wall time, CPU s), last TTL
        self._ticked = -float("inf")  # wall time of the last tick
        self._grace_until = -float("inf")  # listening time: no expiry but the hard limit
        self.held = 0

    # ---- clocks and limits -----------------------------------------------------

    @property
    def base_interval(self) -> float:
        """The heartbeat interval at pace 1: a quarter of the TTL."""
        return self.ttl / 4

    @property
    def heartbeat_interval(self) -> float:
        """The interval the master asks for now (the base interval times the pace)."""
        return self.base_interval * self.pace

    @property
    def ttl_now(self) -> float:
        """The silence (listening time) after which a member expires, stretched by
        the pace workers may still be beating at."""
        return self.ttl * self._ttl_pace

    def listening(self, now: float, late: float = 0.0) -> float:
        """``now`` on the listening clock: wall time minus deaf time. ``late``: how
        late the caller's own timer ran (a datagram drain, the tick before it counts
        its lateness): beyond the tolerance that is deaf time not yet counted."""
        return now - self.deaf - max(0.0, late - LAG_TOLERANCE_TTLS * self.ttl)

    def grace(self, now: float, seconds: float) -> None:
        """Expire nobody (but past the hard limit) for ``seconds`` from ``now``: a new
        leader gives the workers that look for it time to arrive."""
        self._grace_until = max(self._grace_until, self.listening(now) + seconds)

    # ---- membership events -------------------------------------------------------

    def _find(self, worker_id: str, instance: str, now: float) -> Member | None:
        """The live member ``worker_id`` if ``instance`` may act for it, None if unknown.

        Raises IdConflict when it is live and bound to another instance. Another
        instance finds a member whose TTL ran out (not yet swept by :meth:`tick`)
        gone; its own instance may still refresh it.
        """
        m = self.members.get(worker_id)
        if m is None:
            return None
        if m.instance and m.instance != instance:
            if self.listening(now) - m.heard > self.ttl_now + m.grace:
                del self.members[worker_id]
                self.version += 1
                return None
            raise IdConflict(
                f"worker id {worker_id!r} is registered by another live instance "
                f"(last heartbeat {max(0.0, now - m.seen):.1f}s ago); it can be taken "
                f"once it leaves or misses heartbeats for {self.ttl:g}s"
            )
        m.instance = instance  # binds a member restored from an older master's state
        return m

    def _heard(self, m: Member, now: float) -> None:
        m.heard = self.listening(now)
        m.seen = now
        m.grace = 0.0
        self.beats += 1

    def bind(self, worker_id: str, instance: str, now: float) -> Member | None:
        """The member ``worker_id`` for the beats of a stream that names it once (see
        :meth:`beat`), refreshed; None if unknown (it must register again).
        IdConflict when the id is live under another instance token."""
        m = self._find(worker_id, instance, now)
        if m is not None:
            self._heard(m, now)
        return m

    def register(self, info: master_pb2.WorkerInfo, instance: str, now: float) -> bool:
        """Add or refresh a worker; True if the map changed.

        Raises InvalidArgument for an incomplete or oversized registration or a bad
        token, IdConflict when the id is live under another instance token, and
        ResourceExhausted when ``max_workers`` are already registered. A refresh by
        the same instance with the same info keeps the member (and the streams'
        bindings of it).
        """
        check_worker(info)
        check_instance(instance)
        old = self._find(info.id, instance, now)
        if old is None and len(self.members) >= self.max_workers:
            raise ResourceExhausted(f"the cluster already has {self.max_workers} workers")
        grace = REGISTER_GRACE_TTLS * self.ttl  # its beats start after it reads the answer
        if old is not None and old.info == info and not old.draining:
            old.heard, old.seen, old.grace = self.listening(now), now, grace
            return False
        self.members[info.id] = Member(
            info, self.listening(now), instance=instance, seen=now, grace=grace
        )
        self.version += 1
        return True

    def beat(self, m: Member, now: float) -> bool:
        """A sign of life from a member bound earlier (:meth:`bind`): no map work.
        False when that registration is gone (expired, left, replaced by a new one):
        the worker must register again."""
        if self.members.get(m.info.id) is not m:
            return False
        self._heard(m, now)
        return True

    def beat_all(self, members: Iterable[Member | None], now: float) -> list[int]:
        """:meth:`beat` for each; the positions that failed (None counts as failed)."""
        listen = self.listening(now)
        get = self.members.get
        stale: list[int] = []
        n = 0
        for i, m in enumerate(members):
            if m is None or get(m.info.id) is not m:
                stale.append(i)
                continue
            m.heard = listen
            m.seen = now
            m.grace = 0.0
            n += 1
        self.beats += n
        return stale

    def update(
        self,
        m: Member,
        now: float,
        stats: master_pb2.WorkerStats | None = None,
        draining: bool = False,
    ) -> bool:
        """:meth:`beat` that also carries news: new ``stats``, or ``draining`` (a
        draining worker leaves the map at once, so clients stop routing to it)."""
        if not self.beat(m, now):
            return False
        if stats is not None:
            m.stats = stats
        if (draining or (stats is not None and stats.draining)) and not m.draining:
            m.draining = True
            self.version += 1
        return True

    def heartbeat(
        self,
        worker_id: str,
        instance: str,
        stats: master_pb2.WorkerStats,
        now: float,
        draining: bool = False,
    ) -> bool:
        """A heartbeat by id (the unary and per-worker stream protocols). False if the
        worker is unknown (it must register again); IdConflict when the id is live
        under another instance token."""
        m = self._find(worker_id, instance, now)
        return m is not None and self.update(m, now, stats, draining)

    def drain(self, worker_id: str) -> bool:
        """An operator's drain (Master.Drain): the worker leaves the map at once and
        stays a member, draining, as if its heartbeat had said so; True when the map
        changed. NotFound for a worker that is not a member."""
        m = self.members.get(worker_id)
        if m is None:
            raise NotFound(f"no worker {worker_id[:MAX_ID]!r} in the cluster")
        if m.draining:
            return False
        m.draining = True
        self.version += 1
        return True

    def leave(self, worker_id: str, instance: str, now: float) -> bool:
        """Remove a worker; False if unknown. IdConflict for another instance's id."""
        if self._find(worker_id, instance, now) is None:
            return False
        del self.members[worker_id]
        self.version += 1
        return True

    def live_grpc(self, worker_id: str) -> str:
        """The gRPC address ``worker_id`` registered with, "" if unknown."""
        m = self.members.get(worker_id)
        return m.info.grpc if m is not None else ""

    def evict(self, worker_id: str, grpc_addr: str) -> bool:
        """Drop ``worker_id`` if it is still registered at ``grpc_addr``: the caller
        proved the process there gone (its port refuses connections)."""
        m = self.members.get(worker_id)
        if m is None or m.info.grpc != grpc_addr:
            return False
        del self.members[worker_id]
        self.version += 1
        return True

    # ---- time ------------------------------------------------------------------

    def tick(self, now: float, late: float = 0.0, busy: float = 0.0) -> Tick:
        """Time passes: ``now``, how many seconds later than planned this tick ran (the
        master's own lateness), and ``busy``, the share of a core the master used since
        the last tick. Counts the deaf time, sets the pace, and expires the members
        silent for too long (see the module doc)."""
        excess = max(0.0, late - LAG_TOLERANCE_TTLS * self.ttl)
        self.deaf += excess
        if excess > 0:
            self._deaf_log.append((now, excess))
        if self._ticked > -float("inf"):
            self._busy_log.append((now, max(0.0, busy) * (now - self._ticked)))
        self._ticked = now
        for log in (self._deaf_log, self._busy_log):
            while log and now - log[0][0] > self.ttl:
                log.popleft()
        self._set_pace(now)
        listen = self.listening(now)
        ttl = self.ttl_now
        hard = MAX_SILENCE_TTLS * ttl
        wall = now - excess  # this tick's own lateness is nobody's silence either
        silent = [
            (wid, m)
            for wid, m in self.members.items()
            if listen - m.heard > ttl + m.grace or wall - m.seen > hard
        ]
        # A storm is counted over the members quiet for half a TTL, not only those past
        # it: members that fall silent a moment apart are one storm from its first.
        quiet = sum(
            listen - m.heard > STORM_ONSET_TTLS * ttl + m.grace for m in self.members.values()
        )
        storm = quiet >= self.storm_min and quiet > self.storm_fraction * len(self.members)
        hold = (1 + HOLD_TTLS) * ttl
        expired: list[str] = []
        why: list[str] = []
        for wid, m in silent:
            if wall - m.seen > hard:  # whatever the deaf time, the storm or the grace
                rule = f"more than {MAX_SILENCE_TTLS:g} TTLs of wall time"
            elif listen < self._grace_until or (storm and listen - m.heard <= hold + m.grace):
                continue
            else:
                rule = "held through a storm" if storm else "past the TTL"
            if m.grace:
                rule += ", no beat since it registered"
            expired.append(wid)
            why.append(
                f"{wid} (silent {listen - m.heard:.1f}s listening, {wall - m.seen:.1f}s wall: "
                f"{rule})"
            )
        for wid in expired:
            del self.members[wid]
        if expired:
            self.version += 1
        self.held = len(silent) - len(expired)
        overloaded = bool(self._deaf_log) or self.held > 0 or self.pace > 1
        return Tick(expired, self.held, excess, self.pace, overloaded, why)

    def _set_pace(self, now: float) -> None:
        """Double the pace while the master is behind because of its own work (see
        the module doc), halve it after a TTL without that; at most one step per TTL.
        The TTL stretches at once with a higher pace, and shrinks only one TTL after
        a lower one (each worker hears of it within an interval)."""
        deaf = sum(e for _, e in self._deaf_log)
        busy = sum(c for _, c in self._busy_log) / self.ttl
        shed = deaf > SHED_DEAF_TTLS * self.ttl and busy > SHED_BUSY
        if now - self._pace_at >= self.ttl:
            if shed and self.pace < self.max_pace:
                self.pace = min(self.max_pace, self.pace * 2)
                self._pace_at = now
            elif not shed and self.pace > 1:
                self._ttl_pace_until = now + self.ttl_now
                self.pace = max(1.0, self.pace / 2)
                self._pace_at = now
        if self.pace >= self._ttl_pace or now >= self._ttl_pace_until:
            self._ttl_pace = self.pace

    def expire(self, now: float) -> list[str]:
        """Remove workers silent for longer than the TTL (a :meth:`tick` on time)."""
        return self.tick(now).expired

    def ring_note(self, worker_id: str) -> str:
        """How clients' rings bound live member ``worker_id``, in one sentence for
        the log; "" when it gets the ring points its capacity asks for."""
        m = self.members.get(worker_id)
        if m is None or m.draining:
            return ""
        share_binds = vnode_count(m.info.capacity_bytes, self.vnodes_per_gib) > (
            MAX_WORKER_SHARE * MIN_VNODES
        )
        if not share_binds and self._scale_noted:
            return ""  # neither bound can say anything new (O(1) for most joins)
        live = [x.info for x in self.members.values() if not x.draining]
        at = next(i for i, w in enumerate(live) if w.id == worker_id)
        wanted = wanted_counts([w.capacity_bytes for w in live], self.vnodes_per_gib)
        want, got = int(wanted[at]), int(bound_counts(wanted)[at])
        if got >= want:
            return ""
        if want > share_cap(wanted):
            return (
                f"worker {worker_id} registers {live[at].capacity_bytes} bytes ({want} ring "
                f"points), more than {MAX_WORKER_SHARE}x the median worker: clients give it "
                f"{got} points"
            )
        if self._scale_noted:
            return ""  # said once: every later join is scaled alike
        self._scale_noted = True
        return (
            f"the ring of {len(live)} workers would exceed {MAX_RING_POINTS} points: clients "
            f"scale every worker's points down ({want} -> {got} for {worker_id}); a lower "
            "--vnodes-per-gib keeps the capacity proportions exact"
        )

    def shard_map(self) -> master_pb2.ShardMap:
        live = [m.info for _, m in sorted(self.members.items()) if not m.draining]
        return master_pb2.ShardMap(
            version=self.version,
            workers=live,
            vnodes_per_gib=self.vnodes_per_gib,
            replicas=self.replicas,
            cluster_id=self.cluster_id,
        )
