"""The worker's link to the master: register, heartbeat, leave, on one thread.

The worker's registration is bound to an instance token made at process start
(``secrets.token_hex(16)``); every Register, Heartbeat and Leave carries it, and
the master refuses another token for an id that is live (FAILED_PRECONDITION).

- **Waiting for the master**: while no master answers, the link retries with
  exponential backoff (0.2 s doubling up to 5 s) and logs one line when it starts
  waiting, then at most one line every 30 s, and one line when it registers.
- **Id in use**: when the master refuses the id because another live instance
  holds it, the link keeps retrying for one worker TTL plus a margin (a worker
  that was SIGKILLed and restarted under its id gets it once the dead instance's
  registration expires); if the id is still taken and this process never
  registered, ``on_fatal`` is called with a one-line message (the worker exits
  non-zero while the first instance keeps serving). When the master saw the holder
  answer at another address (trailer ``kvstore-id-live``), that happens at once.
- ``on_registered`` runs after the first successful registration (the worker
  turns its health to SERVING there).
- **Heartbeats** go on one long-lived ``Beats`` stream per registration (see
  master.proto): the first batch binds the worker's id and token to slot 0, then
  a beat with nothing new is that slot number alone; stats go along when they
  changed, at most every STATS_EVERY intervals, and a change of ``draining`` at
  once. The link beats at the interval the master's answers ask for (it asks for
  longer ones while it is behind). A master without Beats (UNIMPLEMENTED) gets
  one ``HeartbeatStream`` message per beat, and one without that unary Heartbeat
  calls. When the master answers that it forgot the worker, or ends the stream,
  the link registers again after a random pause of 0.5-1 heartbeat interval; a
  standby's UNAVAILABLE names the leader (``kvstore-leader`` trailer), which the
  link tries next when it is in its master list.
- **Datagram beats** (unless ``datagrams=False``): the bind asks for them; when the
  master grants them (a binding id, a key, its UDP port) each beat is also a 32-byte
  UDP datagram to the master host the channel dialed (:mod:`kvstore.beatgram`), and
  once the master confirms on the stream that they arrive (``datagrams_ok``), a beat
  with nothing new is the datagram alone. When the master says they stopped arriving
  (``datagrams_lost``), the link beats on the stream again and asks for datagrams
  again after a backoff (DATAGRAM_RETRY_S doubling up to DATAGRAM_RETRY_CAP_S); see
  :class:`DatagramBeats`. A new stream binds anew. Retry delays are jittered
  (x0.5-1), so workers that lost the same master do not all come back at the
  same moment. A stream on which the master said nothing for two TTLs is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore_client.errors import Code, KVStoreError
from kvstore_client.proto import master_pb2, master_pb2_grpc
from kvstore_client.security import Tls, metadata, open_channel

from .. import beatgram

log = logging.getLogger(__name__)

# gRPC's own reconnect backoff grows to 120 s by default: keep it near ours, so a
# master that comes back is found within seconds.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
]

TTL_TRAILER = "kvstore-ttl"  # sent by the master with an id conflict (kvstore.master.server)
LIVE_TRAILER = "kvstore-id-live"  # ... with the holder's address when it answers there
LEADER_TRAILER = "kvstore-leader"  # sent by a standby master: the leader's address
DEFAULT_CONFLICT_TTL = 30.0  # when the master did not say its TTL
STATS_EVERY = 2  # changed stats go along at most every this many heartbeat intervals
PROTOCOLS = ("beats", "stream", "unary")  # newest first; UNIMPLEMENTED moves to the next
DATAGRAM_RETRY_S = beatgram.RETRY_S  # after datagrams_lost, ask again this much later ...
DATAGRAM_RETRY_CAP_S = beatgram.RETRY_CAP_S  # ... doubling up to this
ATTENTION_TTLS = 1.25  # nothing heard from the master this long: datagrams ask for an answer


class IdInUse(KVStoreError):
    """This worker's id is held by another live instance (the worker exits)."""

    code = Code.FAILED_PRECONDITION


def new_instance_token() -> str:
    """A fresh random instance token (32 hex characters)."""
    return secrets.token_hex(16)


@dataclass(slots=True)
class Backoff:
    """Exponential backoff: ``first``, doubling, capped at ``cap``; pure."""

    first: float = 0.2
    cap: float = 5.0
    _next: float = 0.0

    def next(self) -> float:
        """The next delay in seconds."""
        d = self._next or self.first
        self._next = min(d * 2, self.cap)
        return d

    def reset(self) -> None:
        self._next = 0.0


@dataclass(slots=True)
class Throttle:
    """True at most once per ``every`` seconds (the first call always); pure."""

    every: float = 30.0
    _last: float | None = None

    def ready(self, now: float) -> bool:
        if self._last is not None and now - self._last < self.every:
            return False
        self._last = now
        return True

    def reset(self) -> None:
        self._last = None


@dataclass(slots=True)
class DatagramBeats:
    """The worker's side of datagram beats for its slot (0) of a Beats stream; pure.

    :meth:`answer` follows the master's answers (a grant, its confirmation, its loss);
    :meth:`beat` says how the next beat with nothing new goes: on the stream, as a
    datagram, or both (granted, not yet confirmed); :meth:`ask` whether the next bind
    asks for datagrams (at the stream's start, and again once the retry is due).
    """

    enabled: bool = True
    slot: int = 0
    grant: master_pb2.DatagramGrant | None = None
    confirmed: bool = False
    seq: int = 0
    retry: Backoff = field(default_factory=lambda: Backoff(DATAGRAM_RETRY_S, DATAGRAM_RETRY_CAP_S))
    retry_at: float | None = None  # lost: ask again from then on (None: not lost)

    def ask(self, now: float) -> bool:
        """Whether a bind now asks for datagrams."""
        return (
            self.enabled and self.grant is None and (self.retry_at is None or now >= self.retry_at)
        )

    def rebind_due(self, now: float) -> bool:
        """Lost earlier and the retry is due: bind again asking for datagrams."""
        return self.enabled and self.retry_at is not None and now >= self.retry_at

    def bound(self) -> None:
        """A bind went out; its answer grants datagrams or not."""
        self.retry_at = None
        self.grant, self.confirmed = None, False

    def answer(self, resp: master_pb2.BeatAnswer, now: float) -> str:
        """Apply one answer; "granted", "confirmed", "lost" or ""."""
        what = ""
        for g in resp.datagrams:
            if g.slot == self.slot and g.port and len(g.key) == beatgram.KEY_BYTES:
                self.grant, self.confirmed, self.seq = g, False, 0
                what = "granted"
        if self.grant is not None and self.slot in resp.datagrams_ok:
            self.confirmed = True
            self.retry.reset()
            what = "confirmed"
        if self.slot in resp.datagrams_lost or self.slot in resp.unknown:
            lost = self.grant is not None and self.slot in resp.datagrams_lost
            self.grant, self.confirmed = None, False
            if lost:  # jittered: workers that lost theirs at once do not all ask at once
                self.retry_at = now + self.retry.next() * (0.5 + random.random() / 2)
                what = "lost"
        return what

    def beat(self, attention: bool = False) -> tuple[bool, bytes | None]:
        """(whether the beat goes on the stream, the datagram to send or None)."""
        g = self.grant
        if g is None:
            return True, None
        self.seq += 1
        flags = beatgram.FLAG_ATTENTION if attention else 0
        return not self.confirmed, beatgram.encode(g.key, g.binding, self.seq, flags)


class MasterLink:
    """Registers the worker and heartbeats until ``stop``; see the module doc."""

    def __init__(
        self,
        masters: list[str],
        *,
        tls: Tls | None,
        token: str,
        worker_id: str,
        info: Callable[[], master_pb2.WorkerInfo],
        stats: Callable[[], master_pb2.WorkerStats],
        on_registered: Callable[[], None],
        on_fatal: Callable[[str], None],
        instance: str | None = None,
        serving: Callable[[], bool] = lambda: True,
        datagrams: bool = True,
    ) -> None:
        self.masters = masters
        self.tls = tls
        self.md = metadata(token)
        self.worker_id = worker_id
        self.instance = instance or new_instance_token()
        self._info = info
        self._stats = stats
        # False while the data plane cannot serve (its accept loop died): then no
        # heartbeat goes out, so the master drops this worker within its TTL instead of
        # clients timing out on it.
        self._serving = serving
        self._on_registered = on_registered
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.ever_registered = False
        self.protocol = PROTOCOLS[0]  # the next one after a master answered UNIMPLEMENTED
        self.datagrams = datagrams  # ask for datagram beats (see DatagramBeats)
        # counts for tests and logs: beats sent on the stream with nothing new, datagrams
        self.stream_beats = 0
        self.datagrams_sent = 0
        self.datagrams_confirmed = False  # the current stream's datagrams arrive

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop heartbeating and Leave (when registered); waits up to ``timeout``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the loop ------------------------------------------------------------

    def _run(self) -> None:
        idx = 0
        registered = False
        interval = 1.0
        ttl = 4.0
        backoff = Backoff()
        say = Throttle()
        waiting_since: float | None = None
        conflict_until: float | None = None
        # the last round ended in a refusal: a Register that succeeds then does not
        # reset the backoff (a bind refused right after it would otherwise loop hot)
        refused = False
        channel = open_channel(self.masters[idx], self.tls, _CHANNEL_OPTIONS)
        try:
            while not self._stop.is_set():
                stub = master_pb2_grpc.MasterStub(channel)
                if not self._serving():
                    if say.ready(time.monotonic()):
                        log.error("the transfer plane is not serving: not heartbeating")
                    self._stop.wait(interval)
                    continue
                try:
                    if not registered:
                        r = stub.Register(
                            master_pb2.RegisterRequest(worker=self._info(), instance=self.instance),
                            timeout=5,
                            metadata=self.md,
                        )
                        interval = r.heartbeat_interval_s or 1.0
                        ttl = r.ttl_s or 4 * interval
                        registered = True
                        after = (
                            f" after {time.monotonic() - waiting_since:.0f}s"
                            if waiting_since is not None
                            else ""
                        )
                        log.info(
                            "registered with master %s as %s%s",
                            self.masters[idx],
                            self.worker_id,
                            after,
                        )
                        waiting_since = conflict_until = None
                        if not refused:
                            backoff.reset()
                            say.reset()
                        if not self.ever_registered:
                            self.ever_registered = True
                            self._on_registered()
                    if self.protocol == "unary":
                        registered = self._unary_heartbeat(stub)
                        delay = interval if registered else _jitter(interval)
                    elif self.protocol == "stream":
                        registered = self._stream_heartbeats(stub, interval, ttl)
                        delay = 0.0 if registered else _jitter(interval)
                    else:
                        registered = self._beats(stub, interval, ttl, self.masters[idx])
                        delay = 0.0 if registered else _jitter(interval)
                    refused = False
                except _Silent as e:  # no answer on the stream for two TTLs
                    registered = False
                    log.warning("%s; reconnecting", e)
                    if len(self.masters) > 1:
                        channel.close()
                        idx = (idx + 1) % len(self.masters)
                        channel = open_channel(self.masters[idx], self.tls, _CHANNEL_OPTIONS)
                    delay = _jitter(backoff.next())
                except (grpc.RpcError, _Refused) as err:
                    f = _Failure.of(err)
                    code = f.code
                    if (
                        code == grpc.StatusCode.UNIMPLEMENTED
                        and registered
                        and self.protocol != PROTOCOLS[-1]
                    ):
                        # an older master: still registered, heartbeat the older way
                        self.protocol = PROTOCOLS[PROTOCOLS.index(self.protocol) + 1]
                        how = "unary calls" if self.protocol == "unary" else "stream"
                        log.warning("master %s is older: heartbeats by %s", self.masters[idx], how)
                        continue
                    registered = False
                    refused = code == grpc.StatusCode.FAILED_PRECONDITION
                    now = time.monotonic()
                    if waiting_since is None:
                        waiting_since = now
                    details = f.details or str(code)
                    if code == grpc.StatusCode.FAILED_PRECONDITION:
                        if conflict_until is None:
                            conflict_until = now + f.ttl * 1.5 + 1.0
                        if f.live_at:  # the holder answers: no use waiting
                            conflict_until = now
                        if not self.ever_registered and now >= conflict_until:
                            self._on_fatal(
                                f"worker id {self.worker_id!r} is in use by another live worker "
                                f"(master {self.masters[idx]}: {details}); stop that worker or "
                                "start this one with another --id"
                            )
                            return
                        if say.ready(now):
                            log.error(
                                "master %s refused this worker: %s", self.masters[idx], details
                            )
                    else:
                        if say.ready(now):
                            log.warning(
                                "waiting for the master at %s (%s: %s); retrying with backoff "
                                "up to %.0fs, this message repeats at most every %.0fs",
                                ", ".join(self.masters),
                                code.name if isinstance(code, grpc.StatusCode) else code,
                                details,
                                backoff.cap,
                                say.every,
                            )
                        if (
                            code
                            in (
                                grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.DEADLINE_EXCEEDED,
                            )
                            and len(self.masters) > 1
                        ):
                            channel.close()
                            # a standby names the leader: go there, else try the next
                            leader = f.leader
                            idx = (
                                self.masters.index(leader)
                                if leader in self.masters and leader != self.masters[idx]
                                else (idx + 1) % len(self.masters)
                            )
                            channel = open_channel(self.masters[idx], self.tls, _CHANNEL_OPTIONS)
                    delay = _jitter(backoff.next())
                self._stop.wait(delay)
            if registered:
                with contextlib.suppress(grpc.RpcError):
                    master_pb2_grpc.MasterStub(channel).Leave(
                        master_pb2.LeaveRequest(worker_id=self.worker_id, instance=self.instance),
                        timeout=2,
                        metadata=self.md,
                    )
        finally:
            channel.close()

    def _beats(
        self, stub: master_pb2_grpc.MasterStub, interval: float, ttl: float, addr: str = ""
    ) -> bool:
        """Heartbeat on one Beats stream (slot 0 is this worker) until ``stop``
        (returns True: still registered) or until the master answers that it forgot
        this worker or ends the stream (returns False: register again).

        Beats at the interval the master's answers ask for, by datagram to the host of
        ``addr`` (the master this stream goes to) once the master granted and
        confirmed them (:class:`DatagramBeats`). Sends nothing while the data plane is
        not serving (the master then drops the worker within its TTL). Raises
        grpc.RpcError when the stream fails, _Refused when the master refuses the bind
        (another instance holds the id), and _Silent when the master said nothing for
        two TTLs.
        """
        done = threading.Event()
        heard = [time.monotonic()]
        pace = [interval, ttl]  # what the master asked for last
        calls: list[Any] = []
        say = Throttle()
        silent = [False]
        gram = DatagramBeats(enabled=self.datagrams)
        lock = threading.Lock()
        udp: list[socket.socket] = []  # connected to the master's beat port once granted
        self.datagrams_confirmed = False

        def send(datagram: bytes) -> None:
            g = gram.grant
            if g is None:
                return
            try:
                if not udp or udp[0].getpeername()[1] != g.port:
                    for s in udp:
                        s.close()
                    udp.clear()
                    udp.append(_udp_to(addr, g.port))
                udp[0].send(datagram)
                self.datagrams_sent += 1
            except OSError:
                pass  # the master notices (datagrams_lost) and the stream carries the beats

        def batches() -> Iterator[master_pb2.BeatBatch]:
            bound = False
            sent: master_pb2.WorkerStats | None = None
            sent_at = -float("inf")
            while not done.is_set():
                if self._serving():
                    now = time.monotonic()
                    st = self._stats()
                    b = master_pb2.BeatBatch()
                    with lock:
                        if not bound or gram.rebind_due(now):
                            b.bind.add(
                                slot=0,
                                worker_id=self.worker_id,
                                instance=self.instance,
                                datagrams=gram.ask(now),
                            )
                            gram.bound()
                            bound = True
                    news = sent is None or st.draining != sent.draining
                    if news or (st != sent and now - sent_at >= STATS_EVERY * pace[0]):
                        b.changed.add(slot=0, stats=st, draining=st.draining)
                        sent, sent_at = st, now
                    elif not b.bind:
                        with lock:
                            on_stream, datagram = gram.beat(
                                now - heard[0] > ATTENTION_TTLS * pace[1]
                            )
                        if datagram is not None:
                            send(datagram)
                        if on_stream:
                            b.alive.append(0)
                            self.stream_beats += 1
                    if b.bind or b.alive or b.changed:
                        yield b
                elif say.ready(time.monotonic()):
                    log.error("the transfer plane is not serving: not heartbeating")
                if self._stop.wait(pace[0]) or done.is_set():
                    return
                if time.monotonic() - heard[0] > 2 * pace[1] and calls:
                    silent[0] = True
                    calls[0].cancel()
                    return

        call = stub.Beats(batches(), metadata=self.md)
        calls.append(call)
        try:
            for resp in call:
                now = heard[0] = time.monotonic()
                if resp.interval_s > 0:
                    if resp.interval_s != pace[0]:
                        log.info("the master asks for a heartbeat every %.2gs", resp.interval_s)
                    pace[0] = resp.interval_s
                if resp.ttl_s > 0:
                    pace[1] = resp.ttl_s
                if resp.refused:
                    raise _Refused(resp.refused[0])
                if resp.unknown:
                    return False
                with lock:
                    what = gram.answer(resp, now)
                if what == "confirmed":
                    self.datagrams_confirmed = True
                    port = gram.grant.port if gram.grant is not None else 0
                    log.info("heartbeats by UDP datagram to %s port %d", _host(addr), port)
                elif what == "lost":
                    self.datagrams_confirmed = False
                    log.warning(
                        "the master hears no datagram beats from this worker: heartbeats on "
                        "the gRPC stream, datagrams again in %.0fs",
                        (gram.retry_at or now) - now,
                    )
            return self._stop.is_set()
        except grpc.RpcError:
            if silent[0]:
                raise _Silent(f"the master said nothing for {2 * pace[1]:g}s") from None
            raise
        finally:
            done.set()
            for s in udp:
                s.close()
            self.datagrams_confirmed = False

    def _unary_heartbeat(self, stub: master_pb2_grpc.MasterStub) -> bool:
        """One unary Heartbeat (masters without HeartbeatStream); True if known."""
        hb = stub.Heartbeat(self._heartbeat(), timeout=5, metadata=self.md)
        return bool(hb.known)

    def _heartbeat(self) -> master_pb2.HeartbeatRequest:
        return master_pb2.HeartbeatRequest(
            worker_id=self.worker_id, stats=self._stats(), instance=self.instance
        )

    def _stream_heartbeats(
        self, stub: master_pb2_grpc.MasterStub, interval: float, ttl: float
    ) -> bool:
        """Heartbeat every ``interval`` on one HeartbeatStream until ``stop`` (returns
        True: still registered) or until the master answers that it forgot this worker
        or ends the stream (returns False: register again).

        Sends nothing while the data plane is not serving (the master then drops
        the worker within its TTL). Raises grpc.RpcError when the stream fails, and
        _Silent when the master said nothing for two TTLs (a hung master or a dead
        connection that TCP did not report).
        """
        done = threading.Event()
        heard = [time.monotonic()]
        calls: list[Any] = []
        say = Throttle()
        silent = [False]

        def requests() -> Iterator[master_pb2.HeartbeatRequest]:
            while not done.is_set():
                if self._serving():
                    yield self._heartbeat()
                elif say.ready(time.monotonic()):
                    log.error("the transfer plane is not serving: not heartbeating")
                if self._stop.wait(interval) or done.is_set():
                    return
                if time.monotonic() - heard[0] > 2 * ttl and calls:
                    silent[0] = True
                    calls[0].cancel()
                    return

        call = stub.HeartbeatStream(requests(), metadata=self.md)
        calls.append(call)
        try:
            for resp in call:
                heard[0] = time.monotonic()
                if not resp.known:
                    return False
            return self._stop.is_set()
        except grpc.RpcError:
            if silent[0]:
                raise _Silent(f"the master said nothing for {2 * ttl:g}s") from None
            raise
        finally:
            done.set()


class _Silent(Exception):
    """The heartbeat stream heard nothing from the master for two TTLs."""


class _Refused(Exception):
    """The master refused this worker's bind on a Beats stream."""

    def __init__(self, refusal: master_pb2.BeatRefusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed call to the master, or a refused bind, as the link acts on it."""

    code: grpc.StatusCode
    details: str
    ttl: float  # FAILED_PRECONDITION: the master's TTL, after which a silent id is free
    live_at: str  # FAILED_PRECONDITION: the holder answers there
    leader: str  # UNAVAILABLE from a standby: the leader's address

    @staticmethod
    def of(err: grpc.RpcError | _Refused) -> _Failure:
        if isinstance(err, _Refused):
            r = err.refusal
            code = next((c for c in grpc.StatusCode if c.value[0] == r.code), None)
            return _Failure(
                code or grpc.StatusCode.UNKNOWN,
                r.message,
                r.ttl_s if r.ttl_s > 0 else DEFAULT_CONFLICT_TTL,
                r.live_at,
                "",
            )
        code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
        return _Failure(
            code,
            (err.details() if isinstance(err, grpc.Call) else "") or "",
            _conflict_ttl(err),
            _trailer(err, LIVE_TRAILER),
            _trailer(err, LEADER_TRAILER),
        )


def _host(addr: str) -> str:
    """The host of a "host:port" master address ("[v6]:port" too)."""
    host = addr.rpartition(":")[0] or addr
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _udp_to(addr: str, port: int) -> socket.socket:
    """A UDP socket connected to ``port`` on the host of master address ``addr``."""
    family, kind, proto, _, target = socket.getaddrinfo(_host(addr), port, type=socket.SOCK_DGRAM)[
        0
    ]
    s = socket.socket(family, kind, proto)
    try:
        s.connect(target)
    except OSError:
        s.close()
        raise
    return s


def _jitter(delay: float) -> float:
    """``delay`` scaled by a random factor in [0.5, 1): spreads workers that fail
    together (a master failover) so they do not all come back at the same moment."""
    return delay * (0.5 + random.random() / 2)


def _trailer(e: grpc.RpcError, key: str) -> str:
    """The value of trailer ``key`` of a failed call, "" when absent."""
    if isinstance(e, grpc.Call):
        for k, v in e.trailing_metadata() or ():
            if k == key:
                return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


def _conflict_ttl(e: grpc.RpcError) -> float:
    """The master's worker TTL from the trailer of an id conflict."""
    with contextlib.suppress(ValueError):
        v = _trailer(e, TTL_TRAILER)
        if v:
            return max(0.0, float(v))
    return DEFAULT_CONFLICT_TTL
