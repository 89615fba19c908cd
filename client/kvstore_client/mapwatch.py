"""The client's link to the masters: it fetches the shard map once and then watches it.

The watch asks for deltas (``WatchShardMapRequest.deltas``): after a full map, each
new version comes as what changed (a few hundred bytes for a worker joining a map of
1,000, instead of the whole ~81 KiB), which :func:`~kvstore_client.routing.merge_map`
turns back into the full map handed to ``apply``. A master older than deltas ignores
the request's flag and sends full maps, which are taken as they are. A delta that
does not fit the map held (the master's history and ours disagree) reopens the
watch for a full map. When a master fails, the next one of the list is tried, with
a backoff of 0.2 s doubling to 2 s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from .errors import Unavailable, from_rpc_error
from .proto import master_pb2, master_pb2_grpc
from .routing import merge_map
from .security import Tls, open_channel

__all__ = ["MapWatch"]

log = logging.getLogger(__name__)


class MapWatch:
    """Fetches and watches the shard map of ``masters`` on a thread of its own; every
    full map newer than the last goes to ``apply`` (called on that thread, and on the
    caller's for :meth:`fetch`)."""

    def __init__(
        self,
        masters: list[str],
        *,
        tls: Tls | None,
        md: Any,
        timeout: float,
        apply: Callable[[master_pb2.ShardMap], None],
    ) -> None:
        self.masters = masters
        self.tls = tls
        self.md = md
        self.timeout = timeout
        self.apply = apply
        self.held: master_pb2.ShardMap | None = None  # the newest full map applied
        self._idx = 0
        self._channel: grpc.Channel | None = None
        self._call: Any = None  # the open WatchShardMap call, to cancel on close
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-watch", daemon=True)

    def stub(self) -> master_pb2_grpc.MasterStub:
        """A stub on the master in use (for the client's other master calls)."""
        if self._channel is None:
            self._channel = open_channel(self.masters[self._idx], self.tls)
        return master_pb2_grpc.MasterStub(self._channel)

    def _next_master(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._idx = (self._idx + 1) % len(self.masters)

    def fetch(self) -> master_pb2.ShardMap:
        """The current map from the first master that answers, applied. Raises
        Unavailable when none does, the auth errors as they are."""
        last: grpc.RpcError | None = None
        for _ in range(len(self.masters)):
            try:
                m = self.stub().GetShardMap(
                    master_pb2.GetShardMapRequest(), timeout=self.timeout, metadata=self.md
                )
            except grpc.RpcError as e:
                last = e
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise from_rpc_error(e) from e
                self._next_master()
                continue
            self._take(m)
            return m
        assert last is not None
        raise Unavailable(f"no master answered at {','.join(self.masters)}: {from_rpc_error(last)}")

    def _take(self, m: master_pb2.ShardMap) -> None:
        if self.held is None or m.version > self.held.version:
            self.held = m
            self.apply(m)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.2
        resync = False
        while not self._closed.is_set():
            try:
                held = None if resync else self.held
                req = master_pb2.WatchShardMapRequest(
                    known_version=held.version if held else 0, deltas=True
                )
                resync = False
                self._call = self.stub().WatchShardMap(req, metadata=self.md)
                for m in self._call:
                    if self.held is not None and m.version <= self.held.version:
                        continue
                    full = merge_map(self.held, m)
                    if full is None:  # a delta for another map: start over, full
                        resync = True
                        self._call.cancel()
                        break
                    self._take(full)
                    backoff = 0.2
                if resync:
                    continue
            except grpc.RpcError:
                if self._closed.is_set():
                    return
                self._next_master()
            except Exception:
                log.exception("shard map watch failed")
            self._closed.wait(backoff)
            backoff = min(backoff * 2, 2.0)

    def close(self) -> None:
        """Stop the watch and close the channel. Idempotent."""
        self._closed.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._channel is not None:
            self._channel.close()
