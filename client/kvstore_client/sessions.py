"""Session hints: tell the workers which blocks belong to an agent session and its state.

A hint is advice (a store that gets none is a plain LRU cache): ``paused`` keeps the
session's blocks (retained in DRAM within a budget, demoted rather than evicted),
``active`` resumes it (its blocks on SSD are prefetched into DRAM), ``ended`` makes
its blocks that no other live session holds the first eviction candidates. See
``kvstore/worker/sessions.py`` for the worker's side.

The hint goes to every worker of the map (a session spans workers), each with the
hashes it owns (grouped like ``batch_exists``); the data plane carries nothing new.

Hints are incremental: a session's chain only grows, so the client remembers, per
session (at most ``MAX_REMEMBERED`` of them, least recently hinted forgotten first),
how many leading hashes every worker took and the last of them; a later hint whose
chain starts with that prefix sends only the hashes after it. The whole chain is sent
again when the chain changed, a worker missed the previous hint, or ``FULL_EVERY``
seconds passed (a worker may have dropped the session meanwhile).

Chain cuts: each hash goes with its depth in the chain. A worker that loses a live
session's block for good (evicted, no SSD copy) drops that session's deeper blocks
(a prefix match cannot reach them until the chain is written again) and returns a
notice in its answer to the session's own client's next hint of that namespace; the
client carries it to every worker in its next hint of that namespace, and each drops
its own deeper blocks of the session unless the session has had an ``active`` hint
since (a new turn rewrites the chain). With chains spread over workers, the room
goes to chains that can still hit instead of tails no lookup reaches.

Whose session: at each worker a session belongs to the client that first hinted it
(its ``Client.identity``, sent with every call); only that client's hints change
it, only its cut notices are applied, and only it gets the session's notices. An
agent's next turn may run on another engine (another Client): its first hint of the
session carries the whole chain (``whole``), which shows the chain the worker holds
(its last hash there, or the last hash there of the previous turn's prompt), and the
session is the new client's from then on. A worker
that holds another client's session and got only the newer part of the chain
answers ``resend``, and this client sends it the whole chain at once. A whole chain
that shows nothing of the held one (a history that changed) starts the session over
there under this client. See docs/SECURITY.md ("Shared tables").
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from .dispatch import Dispatch
from .errors import (
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unauthenticated,
    from_rpc_error,
)
from .keys import check_hashes, check_namespace
from .proto import store_pb2, store_pb2_grpc
from .security import open_channel

STATES = ("active", "paused", "ended")
MAX_SESSION_ID_BYTES = 256
MAX_REMEMBERED = 4096  # sessions whose sent prefix the client remembers
FULL_EVERY = 60.0  # seconds after which a hint carries the whole chain again
MAX_CUTS = 4096  # cut notices one hint carries (a worker refuses more)


def check_hint(session_id: str, state: str, ttl: float | None) -> None:
    """InvalidArgument for a hint every worker would refuse (checked before sending)."""
    if state not in STATES:
        raise InvalidArgument(f"session state must be one of {', '.join(STATES)}, got {state!r}")
    if not isinstance(session_id, str) or not session_id:
        raise InvalidArgument("a session id is a non-empty string")
    if len(session_id.encode()) > MAX_SESSION_ID_BYTES:
        raise InvalidArgument(f"a session id is at most {MAX_SESSION_ID_BYTES} bytes")
    if ttl is not None and not ttl > 0:
        raise InvalidArgument(f"a session ttl must be positive, got {ttl}")


class SessionHints:
    """Sends hints for one client, through its :class:`~kvstore_client.dispatch.Dispatch`
    (one gRPC channel per worker, kept until :meth:`close`)."""

    def __init__(self, d: Dispatch) -> None:
        self._d = d
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        # (ns, session) -> (hashes every worker took, the last of them, when sent in full)
        self._sent: OrderedDict[tuple[str, str], tuple[int, bytes, float]] = OrderedDict()
        # cut notices workers returned, for the next hint of their namespace:
        # (ns, session) -> (depth, turn)
        self._cuts: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()

    def _take_cuts(self, ns: str) -> list[store_pb2.SessionCut]:
        with self._lock:
            mine = [k for k in self._cuts if k[0] == ns][:MAX_CUTS]
            got = [(k[1], *self._cuts.pop(k)) for k in mine]
        return [
            store_pb2.SessionCut(namespace=ns, session_id=n, depth=d, turn=t) for n, d, t in got
        ]

    def _keep_cuts(self, cuts: Sequence[store_pb2.SessionCut]) -> None:
        """Merge notices: per session the latest turn's shallowest cut."""
        with self._lock:
            for c in cuts:
                k = (c.namespace, c.session_id)
                old = self._cuts.get(k)
                if old is None or c.turn > old[1] or (c.turn == old[1] and c.depth < old[0]):
                    self._cuts[k] = (c.depth, c.turn)
            while len(self._cuts) > MAX_REMEMBERED:
                self._cuts.popitem(last=False)

    def _new_part(self, ns: str, session_id: str, hashes: list[bytes], now: float) -> int:
        """How many leading ``hashes`` the workers already hold for this session."""
        with self._lock:
            got = self._sent.get((ns, session_id))
        if got is None:
            return 0
        n, last, full_at = got
        if now - full_at > FULL_EVERY or not 0 < n <= len(hashes) or hashes[n - 1] != last:
            return 0
        return n

    def _remember(
        self,
        ns: str,
        session_id: str,
        state: str,
        hashes: list[bytes],
        skip: int,
        ok: bool,
        now: float,
    ) -> None:
        k = (ns, session_id)
        with self._lock:
            if not ok or state == "ended" or not hashes:
                if not ok or state == "ended":
                    self._sent.pop(k, None)
                return
            full_at = self._sent[k][2] if skip and k in self._sent else now
            self._sent[k] = (len(hashes), hashes[-1], full_at)
            self._sent.move_to_end(k)
            while len(self._sent) > MAX_REMEMBERED:
                self._sent.popitem(last=False)

    def _stub(self, address: str) -> store_pb2_grpc.StoreStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = open_channel(address, self._d.tls)
        return store_pb2_grpc.StoreStub(ch)

    def hint(
        self,
        ns: str,
        session_id: str,
        state: str,
        ttl: float | None = None,
        hashes: Sequence[bytes] = (),
    ) -> int:
        """Send the hint to every worker; returns how many workers took it.

        Only the hashes past the prefix this session's earlier hints delivered are sent
        (see the module docstring), with their depths in the chain; the workers add
        them to what they hold. The hint carries the cut notices workers returned to
        this client's earlier hints in ``ns`` (see the module docstring).
        Blocks until every worker answered or the client's timeout passed. Raises
        InvalidArgument / PermissionDenied for a hint the caller got wrong; an
        unreachable worker is skipped (hints are advice), so the result may be short.
        """
        d = self._d
        check_namespace(ns)
        check_hint(session_id, state, ttl)
        hashes = list(hashes)
        check_hashes(hashes)
        now = time.monotonic()
        skip = self._new_part(ns, session_id, hashes, now)
        view, groups = d.copy_groups(ns, hashes[skip:])
        new = hashes[skip:]
        owned = {w: idx for w, idx in groups}
        empty = np.zeros(0, dtype=np.int64)
        cuts = self._take_cuts(ns)
        tasks: list[Callable[[], store_pb2.SessionHintResponse]] = []
        for w, link in enumerate(view.workers):
            idx = owned.get(w, empty)
            req = store_pb2.SessionHintRequest(
                namespace=ns,
                session_id=session_id,
                state=state,
                hashes=b"".join(new[i] for i in idx),
                ttl_seconds=ttl or 0.0,
                depths=(idx + skip).tolist(),
                cuts=cuts,
                whole=not skip and bool(hashes),
            )
            tasks.append(self._task(link.info.grpc, req))
        errors: list[KVStoreError] = []

        def on_error(_: int, e: KVStoreError) -> None:
            errors.append(e)

        got = d.fan_out(tasks, on_error)
        answers = [r for r in got if r is not None]
        again = {view.workers[w].info.grpc for w, r in enumerate(got) if r is not None and r.resend}
        if again and skip:  # another client's session there: show it the whole chain
            answers += self._resend(ns, session_id, state, ttl, hashes, again, on_error)
        took = sum(1 for r in answers if not r.resend)
        for r in answers:
            if r.cuts:
                self._keep_cuts(r.cuts)
        self._remember(ns, session_id, state, hashes, skip, took == len(tasks), now)
        for e in errors:
            if isinstance(e, InvalidArgument | PermissionDenied | Unauthenticated):
                raise e
        return took

    def _resend(
        self,
        ns: str,
        session_id: str,
        state: str,
        ttl: float | None,
        hashes: list[bytes],
        addresses: set[str],
        on_error: Callable[[int, KVStoreError], None],
    ) -> list[store_pb2.SessionHintResponse]:
        """The hint again, with the whole chain, to the workers at ``addresses`` (they
        hold the session as another client's and answered ``resend``)."""
        view, groups = self._d.copy_groups(ns, hashes)
        owned = {w: idx for w, idx in groups}
        empty = np.zeros(0, dtype=np.int64)
        tasks = []
        for w, link in enumerate(view.workers):
            if link.info.grpc not in addresses:
                continue
            idx = owned.get(w, empty)
            req = store_pb2.SessionHintRequest(
                namespace=ns,
                session_id=session_id,
                state=state,
                hashes=b"".join(hashes[i] for i in idx),
                ttl_seconds=ttl or 0.0,
                depths=idx.tolist(),
                whole=True,
            )
            tasks.append(self._task(link.info.grpc, req))
        return [r for r in self._d.fan_out(tasks, on_error) if r is not None]

    def _task(
        self, address: str, req: store_pb2.SessionHintRequest
    ) -> Callable[[], store_pb2.SessionHintResponse]:
        def call() -> store_pb2.SessionHintResponse:
            try:
                return self._stub(address).SessionHint(  # type: ignore[no-any-return]
                    req, timeout=self._d.timeout, metadata=self._d.md
                )
            except grpc.RpcError as e:
                raise from_rpc_error(e) from e

        return call

    def sessions(self, limit: int = 10) -> list[store_pb2.SessionsResponse]:
        """Every reachable worker's session table (top ``limit`` sessions each)."""
        out = []
        view = self._d.view
        for link in view.workers if view else []:
            try:
                out.append(
                    self._stub(link.info.grpc).Sessions(
                        store_pb2.SessionsRequest(limit=limit),
                        timeout=self._d.timeout,
                        metadata=self._d.md,
                    )
                )
            except grpc.RpcError as e:
                raise from_rpc_error(e) from e
        return out

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
