"""The master's UDP socket for datagram beats (see master.proto, "Datagram beats"):
opened once, non-blocking, read in a loop every DRAIN_S on the event loop (no
callback per datagram), into one preallocated buffer (:class:`BeatSocket`). What is
read is checked by :class:`kvstore.master.datagrams.Datagrams`, which does no I/O;
:class:`BeatEar` runs the reading and wakes the Beats streams that must say
something about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any, Protocol

from kvstore_client.proto import master_pb2

from .. import beatgram, metrics
from .beats import BeatSession, survey
from .datagrams import Datagrams
from .membership import Membership

log = logging.getLogger(__name__)

__all__ = ["DRAIN_S", "MAX_PER_DRAIN", "RCVBUF", "BeatEar", "BeatSocket", "beat_port"]

DRAIN_S = 0.1  # the socket is read this often
# Beats waiting between two reads: a few hundred ms of 10,000 beats/s. The kernel
# charges each small datagram ~1 KiB of buffer (its skb), so ask for 4 MiB (the kernel
# caps the request at net.core.rmem_max and doubles it).
RCVBUF = 4 << 20
MAX_PER_DRAIN = 20_000  # a flood is read at most this far per drain; the rest waits or drops
BUF_BYTES = 64  # larger datagrams are truncated to this and dropped as malformed


def beat_port(setting: str, grpc_port: int) -> int | None:
    """The UDP port to bind for ``--beat-port`` ``setting``: "" the gRPC port's number,
    "0" any free port, "off" none (None)."""
    s = setting.strip().lower()
    if s == "off":
        return None
    if s == "":
        return grpc_port
    return int(s)


class BeatSocket:
    """A bound, non-blocking UDP socket and its receive buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.port = int(sock.getsockname()[1])
        self.rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self._buf = bytearray(BUF_BYTES)
        self._view = memoryview(self._buf)

    @classmethod
    def open(cls, host: str, port: int) -> BeatSocket | None:
        """Bind ``host``:``port`` (UDP); None, with a warning, when that fails (workers
        then beat on their streams)."""
        sock: socket.socket | None = None
        try:
            bind_host = host or "0.0.0.0"
            family, _, _, _, addr = socket.getaddrinfo(
                bind_host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, socket.SOCK_DGRAM)
            if family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            sock.bind(addr)
            sock.setblocking(False)
        except OSError as e:
            if sock is not None:
                sock.close()
            log.warning(
                "cannot open the UDP beat port %s:%d (%s): workers beat on their gRPC "
                "streams (--beat-port picks another port, off turns datagram beats off)",
                host,
                port,
                e.strerror or e,
            )
            return None
        return cls(sock)

    def read(self, limit: int = MAX_PER_DRAIN) -> Iterator[memoryview]:
        """The datagrams waiting now (at most ``limit``), each a view of the one buffer,
        valid until the next is read."""
        recv_into, buf, view = self.sock.recv_into, self._buf, self._view
        for _ in range(limit):
            try:
                n = recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. an ICMP error queued on the socket: read again next time
            yield view[:n]

    def close(self) -> None:
        self.sock.close()


assert beatgram.SIZE <= BUF_BYTES


class _Master(Protocol):
    m: Membership

    @property
    def is_leader(self) -> bool: ...


class BeatEar:
    """The beat socket of a master (every master: a standby holds no bindings, so it
    drops everything), its bindings, and the Beats streams beating by datagram, each
    with the future its handler waits on (an answer to push, or None: check the
    leadership)."""

    def __init__(self, master: _Master) -> None:
        self.master = master
        self.socket: BeatSocket | None = None
        self.datagrams = Datagrams()
        self.streams: dict[BeatSession, asyncio.Future[master_pb2.BeatAnswer | None]] = {}
        self._counts = dict(self.datagrams.counts)  # as last exported
        self._events = dict(self.datagrams.events)
        self._polled = -float("inf")
        self._storm = False
        self._storm_said = -float("inf")
        self._task: asyncio.Task[None] | None = None

    def open(self, host: str, port: int) -> None:
        """Read datagram beats at UDP ``host``:``port`` from now on (on this loop)."""
        self.socket = BeatSocket.open(host, port)
        if self.socket is None:
            return
        self.datagrams.port = self.socket.port
        self._task = asyncio.create_task(self._loop(), name="beat-datagrams")
        log.info(
            "datagram beats on UDP port %d (receive buffer %d KiB)",
            self.socket.port,
            self.socket.rcvbuf >> 10,
        )

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.socket is not None:
            self.socket.close()

    async def _loop(self) -> None:
        while True:
            due = time.monotonic() + DRAIN_S
            await asyncio.sleep(DRAIN_S)
            try:
                self.drain(time.monotonic() - due)
            except Exception:  # never let a bad read stop the beats
                log.exception("reading datagram beats failed")

    def drain(self, late: float = 0.0) -> None:
        """Read the beat socket dry, count the good datagrams as beats at this moment,
        and wake the streams that have something to say: at once those whose bindings
        changed, and every stream beating by datagram every TTL/10 (lost bindings, a
        new interval, the sign of life). The master's ear for datagrams: the expiry
        tick calls it first, so beats that waited in the socket while the master was
        behind count before anyone is judged silent. ``late``: how late the caller's
        timer ran; a binding's silence does not count it (a master starved that long
        heard nobody; :meth:`Membership.listening`)."""
        sock = self.socket
        if sock is None:
            return
        now = time.monotonic()
        m = self.master.m
        b0 = m.beats
        woken = self.datagrams.apply(m, sock.read(), now)
        if m.beats != b0:
            metrics.HEARTBEATS.inc(m.beats - b0)
        for counts, last, metric in (
            (self.datagrams.counts, self._counts, metrics.BEAT_DATAGRAMS),
            (self.datagrams.events, self._events, metrics.BEAT_BINDINGS),
        ):
            for result, n in counts.items():
                if n != last[result]:
                    metric.labels(result).inc(n - last[result])
                    last[result] = n
        streams = self.streams
        if not streams:
            return
        if not self.master.is_leader:
            for fut in streams.values():
                if not fut.done():
                    fut.set_result(None)  # the handler ends the stream
            return
        sessions: Any
        if now - self._polled >= max(DRAIN_S, m.ttl / 10):
            self._polled = now
            storm = survey(self.datagrams, m, now, late)
            if storm and not self._storm and now - self._storm_said >= 30.0:
                self._storm_said = now
                log.warning(
                    "many workers' datagram beats are late at once (their host, the "
                    "network or this master is behind): their bindings are kept longer"
                )
            self._storm = storm
            sessions = list(streams)
        else:
            sessions = {b.owner for b in woken}
        for session in sessions:
            waiting = streams.get(session)
            if waiting is not None and not waiting.done():
                answer = session.poll(m, now, late)
                if answer is not None:
                    waiting.set_result(answer)
