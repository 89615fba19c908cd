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
  non-zero while the first instance keeps serving).
- ``on_registered`` runs after the first successful registration (the worker
  turns its health to SERVING there).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvstore_client.errors import Code, KVStoreError
from kvstore_client.proto import master_pb2, master_pb2_grpc
from kvstore_client.security import Tls, metadata, open_channel

log = logging.getLogger(__name__)

# gRPC's own reconnect backoff grows to 120 s by default: keep it near ours, so a
# master that comes back is found within seconds.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
]

TTL_TRAILER = "kvstore-ttl"  # sent by the master with an id conflict (kvstore.master.server)
DEFAULT_CONFLICT_TTL = 30.0  # when the master did not say its TTL


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
        backoff = Backoff()
        say = Throttle()
        waiting_since: float | None = None
        conflict_until: float | None = None
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
                        backoff.reset()
                        say.reset()
                        if not self.ever_registered:
                            self.ever_registered = True
                            self._on_registered()
                    hb = stub.Heartbeat(
                        master_pb2.HeartbeatRequest(
                            worker_id=self.worker_id, stats=self._stats(), instance=self.instance
                        ),
                        timeout=5,
                        metadata=self.md,
                    )
                    registered = hb.known
                    delay = interval if registered else 0.0
                except grpc.RpcError as e:
                    registered = False
                    now = time.monotonic()
                    if waiting_since is None:
                        waiting_since = now
                    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
                    details = (e.details() if isinstance(e, grpc.Call) else "") or str(code)
                    if code == grpc.StatusCode.FAILED_PRECONDITION:
                        if conflict_until is None:
                            conflict_until = now + _conflict_ttl(e) * 1.5 + 1.0
                        if not self.ever_registered and now > conflict_until:
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
                            idx = (idx + 1) % len(self.masters)
                            channel = open_channel(self.masters[idx], self.tls, _CHANNEL_OPTIONS)
                    delay = backoff.next()
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


def _conflict_ttl(e: grpc.RpcError) -> float:
    """The master's worker TTL from the trailer of an id conflict."""
    if isinstance(e, grpc.Call):
        for k, v in e.trailing_metadata() or ():
            if k == TTL_TRAILER:
                with contextlib.suppress(ValueError):
                    return max(0.0, float(v if isinstance(v, str) else v.decode()))
    return DEFAULT_CONFLICT_TTL
