"""A small asyncio client for etcd's v3 gRPC API: the calls the HA master needs.

It speaks etcd's own gRPC services (KV, Lease, Watch) over ``grpc.aio`` with the
message and stub classes generated from etcd's protos that ship in the
``etcd-sdk-python`` package (import name ``pyetcd``). That package's own client
is blocking (a thread per watch, a blocking call per lease refresh), which fits
the asyncio master badly, so only its generated code is used here.

Every call has a deadline. Any failure to reach etcd raises
:class:`EtcdUnavailable` (a :class:`~kvstore.errors.Unavailable`) and moves on to
the next endpoint of a comma-separated list.

TLS: ``https://`` endpoints (all of them, or none) are dialled over TLS with an
:class:`EtcdTls` (CA bundle, optional client certificate and key, read from PEM
files at start; without a CA file the system's roots are used). The endpoint's
host must be named in the etcd server certificate's subjectAltName.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from .. import metrics
from ..errors import InvalidArgument, Unavailable
from .snapshot import prefix_end

try:  # the generated etcd v3 messages and stubs (package etcd-sdk-python)
    from pyetcd.etcdrpc import kv_pb2 as _kv  # type: ignore[import-untyped,import-not-found]
    from pyetcd.etcdrpc import rpc_pb2 as _rpc  # type: ignore[import-untyped,import-not-found]
    from pyetcd.etcdrpc import (  # type: ignore[import-untyped,import-not-found]
        rpc_pb2_grpc as _rpc_grpc,
    )
except ImportError as e:  # pragma: no cover - depends on the install
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

log = logging.getLogger(__name__)
T = TypeVar("T")
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # end of a stream (no stub)

# etcd refuses transactions with more operations than --max-txn-ops (default 128).
MAX_TXN_OPS = 100

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),  # etcd accepts pings every 5 s or slower
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


class EtcdUnavailable(Unavailable):
    """etcd could not be reached in time, or ended a stream."""


class WatchCompacted(EtcdUnavailable):
    """The watch started at a revision etcd has compacted away: read the state again."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0  # the lease the key is attached to; 0 for none


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change: ``value`` is empty for a delete."""

    key: bytes
    value: bytes
    deleted: bool


def parse_endpoints(text: str) -> tuple[list[str], bool]:
    """ "https://h1:2379,https://h2:2379" -> (["h1:2379", "h2:2379"], True).

    The second item says whether the endpoints use TLS (``https://``); a bare
    ``host:port`` is plain. InvalidArgument when malformed or when plain and TLS
    endpoints are mixed.
    """
    out: list[str] = []
    schemes: set[bool] = set()
    for raw in text.split(","):
        ep = raw.strip()
        if not ep:
            continue
        secure = ep.startswith("https://")
        if ep.startswith("unix://") or ep.startswith("unixs://"):
            raise InvalidArgument(f"etcd endpoint {ep!r}: unix sockets are not supported")
        ep = ep.removeprefix("https://").removeprefix("http://").rstrip("/")
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or "/" in ep:
            raise InvalidArgument(
                f"bad etcd endpoint {raw.strip()!r}: want http://host:port or https://host:port"
            )
        out.append(ep)
        schemes.add(secure)
    if not out:
        raise InvalidArgument("no etcd endpoint given")
    if len(schemes) > 1:
        raise InvalidArgument(f"etcd endpoints mix http:// and https://: {text!r}")
    return out, schemes == {True}


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """PEM bytes for TLS to etcd: the CA bundle (None: system roots) and an optional
    client certificate and key (for etcd's --client-cert-auth)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @staticmethod
    def from_files(ca: str = "", cert: str = "", key: str = "") -> EtcdTls:
        """Read the files; InvalidArgument naming the file or the missing half."""
        if bool(cert) != bool(key):
            raise InvalidArgument(
                "a client certificate for etcd needs both --etcd-cert and --etcd-key"
            )

        def read(path: str, flag: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise InvalidArgument(f"{flag} {path}: {e.strerror or e}") from e
            if b"-----BEGIN" not in data:
                raise InvalidArgument(f"{flag} {path}: not a PEM file")
            return data

        return EtcdTls(read(ca, "--etcd-ca"), read(cert, "--etcd-cert"), read(key, "--etcd-key"))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _kv_of(pb: Any) -> KeyValue:
    return KeyValue(
        bytes(pb.key),
        bytes(pb.value),
        int(pb.create_revision),
        int(pb.mod_revision),
        int(pb.lease),
    )


class EtcdClient:
    """Connection to an etcd cluster; see the module docstring. Not thread-safe:
    use it from one event loop."""

    def __init__(self, endpoints: str, *, timeout: float = 3.0, tls: EtcdTls | None = None) -> None:
        if _IMPORT_ERROR is not None:
            raise InvalidArgument(
                "--etcd needs the package etcd-sdk-python (pip install etcd-sdk-python): "
                f"{_IMPORT_ERROR}"
            )
        self.endpoints, secure = parse_endpoints(endpoints)
        if secure and tls is None:
            tls = EtcdTls()  # https:// with the system's roots
        if tls is not None and not secure:
            raise InvalidArgument(
                "etcd TLS files were given but the etcd endpoints are http://: use https://"
            )
        self.tls = tls
        self._creds = tls.credentials() if tls is not None else None
        self.timeout = timeout
        self._idx = 0
        self._channel: grpc.aio.Channel = self._open(0)
        self._retired: list[grpc.aio.Channel] = []

    @property
    def endpoint(self) -> str:
        """The endpoint in use now."""
        return self.endpoints[self._idx]

    def _open(self, idx: int) -> grpc.aio.Channel:
        if self._creds is not None:
            return grpc.aio.secure_channel(
                self.endpoints[idx], self._creds, options=_CHANNEL_OPTIONS
            )
        return grpc.aio.insecure_channel(self.endpoints[idx], options=_CHANNEL_OPTIONS)

    def _rotate(self, failed_idx: int) -> None:
        """Move to the next endpoint unless another call already did."""
        if len(self.endpoints) == 1 or failed_idx != self._idx:
            return
        self._retired.append(self._channel)
        self._idx = (self._idx + 1) % len(self.endpoints)
        self._channel = self._open(self._idx)
        log.warning("etcd: switching to endpoint %s", self.endpoint)

    async def close(self) -> None:
        """Close every channel; pending calls fail. Idempotent."""
        for ch in [*self._retired, self._channel]:
            with contextlib.suppress(Exception):
                await ch.close(None)
        self._retired.clear()

    async def _unary(self, op: str, call: Callable[[grpc.aio.Channel], Awaitable[T]]) -> T:
        idx = self._idx
        try:
            return await call(self._channel)
        except grpc.aio.AioRpcError as e:
            metrics.ETCD_ERRORS.labels(op).inc()
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._rotate(idx)
            raise EtcdUnavailable(
                f"etcd {self.endpoints[idx]} {op}: {e.code().name}: {e.details()}"
            ) from e

    # ---- leases --------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        req = _rpc.LeaseGrantRequest(TTL=ttl)
        resp = await self._unary(
            "lease_grant",
            lambda ch: _rpc_grpc.LeaseStub(ch).LeaseGrant(req, timeout=self.timeout),
        )
        if resp.error:
            raise EtcdUnavailable(f"etcd refused a lease: {resp.error}")
        return int(resp.ID)

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease: every key attached to it is deleted at once."""
        req = _rpc.LeaseRevokeRequest(ID=lease_id)
        await self._unary(
            "lease_revoke",
            lambda ch: _rpc_grpc.LeaseStub(ch).LeaseRevoke(req, timeout=self.timeout),
        )

    async def time_to_live(self, lease_id: int) -> float | None:
        """Seconds left on a lease (etcd rounds down to whole seconds); None if it is gone."""
        req = _rpc.LeaseTimeToLiveRequest(ID=lease_id)
        resp = await self._unary(
            "lease_ttl",
            lambda ch: _rpc_grpc.LeaseStub(ch).LeaseTimeToLive(req, timeout=self.timeout),
        )
        return float(resp.TTL) if resp.TTL >= 0 else None

    async def keep_alive(self, lease_id: int, ttl: float) -> None:
        """Refresh the lease every ``ttl / 3`` seconds; returns once it is lost.

        Lost means etcd answered that the lease expired, or no refresh succeeded
        for so long that etcd must have expired it (counted conservatively from
        the time the last successful refresh was sent). Cancel the task to stop.
        """
        interval = max(0.1, ttl / 3)
        deadline = time.monotonic() + ttl
        while time.monotonic() < deadline:
            idx = self._idx
            stream = _rpc_grpc.LeaseStub(self._channel).LeaseKeepAlive()
            try:
                while True:
                    sent = time.monotonic()
                    wait = max(0.05, min(self.timeout, deadline - sent))
                    await asyncio.wait_for(
                        stream.write(_rpc.LeaseKeepAliveRequest(ID=lease_id)), wait
                    )
                    resp = await asyncio.wait_for(stream.read(), wait)
                    if resp is _EOF:
                        raise EtcdUnavailable("etcd closed the keep-alive stream")
                    if resp.TTL <= 0:
                        log.warning("etcd: lease %x expired", lease_id)
                        return
                    deadline = sent + float(resp.TTL)
                    await asyncio.sleep(interval)
            except (grpc.aio.AioRpcError, EtcdUnavailable, TimeoutError) as e:
                metrics.ETCD_ERRORS.labels("lease_keepalive").inc()
                log.warning("etcd: lease refresh failed: %r", e)
                self._rotate(idx)
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            finally:
                stream.cancel()
        log.warning("etcd: lease %x presumed expired (no refresh for %.1fs)", lease_id, ttl)

    # ---- keys ----------------------------------------------------------------

    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store revision of that read."""
        req = _rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        resp = await self._unary(
            "range", lambda ch: _rpc_grpc.KVStub(ch).Range(req, timeout=self.timeout)
        )
        return int(resp.header.revision), [_kv_of(kv) for kv in resp.kvs]

    async def create_if_absent(
        self, key: bytes, value: bytes, lease_id: int
    ) -> tuple[bool, KeyValue | None]:
        """Put ``key`` on the lease only if it does not exist (an election).

        Returns (True, the new key) when this call created it, else (False, the
        key that exists now, or None if it vanished in between).
        """
        cmp = _rpc.Compare(
            key=key, target=_rpc.Compare.CREATE, result=_rpc.Compare.EQUAL, create_revision=0
        )
        put = _rpc.RequestOp(request_put=_rpc.PutRequest(key=key, value=value, lease=lease_id))
        get = _rpc.RequestOp(request_range=_rpc.RangeRequest(key=key))
        req = _rpc.TxnRequest(compare=[cmp], success=[put], failure=[get])
        resp = await self._unary(
            "txn", lambda ch: _rpc_grpc.KVStub(ch).Txn(req, timeout=self.timeout)
        )
        rev = int(resp.header.revision)
        if resp.succeeded:
            return True, KeyValue(key, value, rev, rev, lease_id)
        kvs = resp.responses[0].response_range.kvs
        return False, (_kv_of(kvs[0]) if kvs else None)

    async def fenced_write(
        self,
        fence_key: bytes,
        fence_revision: int,
        puts: Sequence[tuple[bytes, bytes]],
        deletes: Sequence[bytes],
    ) -> bool:
        """Apply puts and deletes in one transaction, only while ``fence_key`` is
        still the key created at ``fence_revision`` (we are still the leader).

        Returns False when the fence no longer holds (nothing was written).
        """
        if len(puts) + len(deletes) > MAX_TXN_OPS:
            raise InvalidArgument(f"more than {MAX_TXN_OPS} operations in one transaction")
        cmp = _rpc.Compare(
            key=fence_key,
            target=_rpc.Compare.CREATE,
            result=_rpc.Compare.EQUAL,
            create_revision=fence_revision,
        )
        ops = [_rpc.RequestOp(request_put=_rpc.PutRequest(key=k, value=v)) for k, v in puts]
        ops += [
            _rpc.RequestOp(request_delete_range=_rpc.DeleteRangeRequest(key=k)) for k in deletes
        ]
        req = _rpc.TxnRequest(compare=[cmp], success=ops)
        resp = await self._unary(
            "txn", lambda ch: _rpc_grpc.KVStub(ch).Txn(req, timeout=self.timeout)
        )
        return bool(resp.succeeded)

    # ---- watch ---------------------------------------------------------------

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Changes under ``prefix`` from ``start_revision`` on, one list per revision
        batch. Ends only by raising: EtcdUnavailable when the stream breaks,
        WatchCompacted when the start revision is gone (read the state again)."""
        idx = self._idx
        stream = _rpc_grpc.WatchStub(self._channel).Watch()
        create = _rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision
        )
        try:
            await asyncio.wait_for(
                stream.write(_rpc.WatchRequest(create_request=create)), self.timeout
            )
            while True:
                resp = await stream.read()
                if resp is _EOF:
                    raise EtcdUnavailable("etcd closed the watch stream")
                if resp.compact_revision:
                    raise WatchCompacted(f"revision {start_revision} was compacted")
                if resp.canceled:
                    raise EtcdUnavailable(f"etcd canceled the watch: {resp.cancel_reason}")
                if resp.events:
                    yield [
                        WatchEvent(
                            bytes(ev.kv.key), bytes(ev.kv.value), ev.type == _kv.Event.DELETE
                        )
                        for ev in resp.events
                    ]
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            metrics.ETCD_ERRORS.labels("watch").inc()
            self._rotate(idx)
            raise EtcdUnavailable(f"etcd watch failed: {e}") from e
        finally:
            stream.cancel()
