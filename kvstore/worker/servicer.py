"""gRPC Store service of a worker: translates requests to BlockStore calls.

Misses are results, not errors. Bad input is INVALID_ARGUMENT, a full tier
RESOURCE_EXHAUSTED, a draining worker UNAVAILABLE (see kvstore.errors).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from kvstore_client.keys import HASH_LEN, split_hashes, to_bitmap
from kvstore_client.proto import store_pb2, store_pb2_grpc

from .. import metrics
from ..auth import Tenant, bearer, client_identity
from ..errors import InvalidArgument, PermissionDenied, Unavailable, abort, to_grpc_code
from .handoff import HandOffResult
from .requests import RequestCore
from .sessions import check_hint
from .store import BlockStore
from .storerecords import StoreStats, stats_message

R = TypeVar("R")


class StoreServicer(store_pb2_grpc.StoreServicer):
    def __init__(
        self,
        store: BlockStore,
        worker_id: str,
        stats: Callable[[], StoreStats],
        core: RequestCore,
    ):
        self.store = store
        self.core = core
        self.worker_id = worker_id
        self.draining = False
        self._stats = stats
        # Store.HandOff: set by the worker (kvstore.worker.handoff); None refuses it
        self.hand_off: Callable[[float], HandOffResult] | None = None

    def _run(self, op: str, context: grpc.ServicerContext, fn: Callable[[Tenant | None], R]) -> R:
        t0 = time.perf_counter()
        try:
            tenant = self.core.authenticate(bearer(context.invocation_metadata()))
            if self.draining and op not in ("stats",):
                raise Unavailable("worker is draining")
            out = fn(tenant)
            metrics.REQUESTS.labels(op, "OK").inc()
            return out
        except Exception as e:
            metrics.REQUESTS.labels(op, to_grpc_code(e).name).inc()
            abort(context, e)
        finally:
            metrics.LATENCY.labels(op).observe(time.perf_counter() - t0)

    def _ns(self, tenant: Tenant | None, ns: str) -> str:
        return self.core.admit(tenant, ns)

    def _keys(self, tenant: Tenant | None, ns: str, packed: bytes) -> tuple[str, list[bytes]]:
        ns = self.core.admit(tenant, ns)
        self.core.check_batch(len(packed) // HASH_LEN)  # before unpacking anything
        return ns, split_hashes(packed)

    def Exists(
        self, request: store_pb2.ExistsRequest, context: grpc.ServicerContext
    ) -> store_pb2.ExistsResponse:
        def go(tenant: Tenant | None) -> store_pb2.ExistsResponse:
            ns, keys = self._keys(tenant, request.namespace, request.hashes)
            flags = self.store.exists(ns, keys)
            metrics.count_tenant(_name(tenant), hits=sum(flags), lookups=len(flags))
            return store_pb2.ExistsResponse(bitmap=to_bitmap(flags), count=len(flags))

        return self._run("exists", context, go)

    def MatchPrefix(
        self, request: store_pb2.MatchPrefixRequest, context: grpc.ServicerContext
    ) -> store_pb2.MatchPrefixResponse:
        def go(tenant: Tenant | None) -> store_pb2.MatchPrefixResponse:
            ns, keys = self._keys(tenant, request.namespace, request.hashes)
            state = request.state_namespace
            if state:
                self._ns(tenant, state)
            matched = self.store.match_prefix(ns, keys, state)
            metrics.count_tenant(_name(tenant), hits=matched, lookups=len(keys))
            return store_pb2.MatchPrefixResponse(matched=matched)

        return self._run("match_prefix", context, go)

    def Put(
        self, request: store_pb2.PutRequest, context: grpc.ServicerContext
    ) -> store_pb2.PutResponse:
        def go(tenant: Tenant | None) -> store_pb2.PutResponse:
            ns, keys = self._keys(tenant, request.namespace, request.hashes)
            values = list(request.values)
            if len(values) != len(keys):
                raise InvalidArgument(f"{len(keys)} hashes but {len(values)} values")
            self.core.check_sizes([len(v) for v in values])
            stored = self.store.put_bytes(ns, keys, values)
            metrics.count_tenant(_name(tenant), nin=sum(len(v) for v in values))
            return store_pb2.PutResponse(stored_bitmap=to_bitmap(stored))

        return self._run("put", context, go)

    def Get(
        self, request: store_pb2.GetRequest, context: grpc.ServicerContext
    ) -> store_pb2.GetResponse:
        def go(tenant: Tenant | None) -> store_pb2.GetResponse:
            ns, keys = self._keys(tenant, request.namespace, request.hashes)
            # Bounded before anything is copied: one hash repeated must not cost gigabytes.
            self.core.check_answer(self.store.sizes(ns, keys), inline=True)
            vals = self.store.get_bytes(ns, keys)
            found = [v for v in vals if v is not None]
            metrics.count_tenant(
                _name(tenant),
                hits=len(found),
                lookups=len(vals),
                nout=sum(len(v) for v in found),
            )
            return store_pb2.GetResponse(
                found_bitmap=to_bitmap([v is not None for v in vals]),
                values=[v if v is not None else b"" for v in vals],
            )

        return self._run("get", context, go)

    def Remove(
        self, request: store_pb2.RemoveRequest, context: grpc.ServicerContext
    ) -> store_pb2.RemoveResponse:
        def go(tenant: Tenant | None) -> store_pb2.RemoveResponse:
            ns, keys = self._keys(tenant, request.namespace, request.hashes)
            return store_pb2.RemoveResponse(removed=self.store.remove(ns, keys))

        return self._run("remove", context, go)

    def RemoveNamespace(
        self, request: store_pb2.RemoveNamespaceRequest, context: grpc.ServicerContext
    ) -> store_pb2.RemoveNamespaceResponse:
        # Prefix semantics, like tenant ownership: "t" removes "t" and every "t/...",
        # never "tx". A tenant that owns "t" owns all of these (tenants' namespaces
        # never overlap), so the one ownership check covers them. In slices.
        def go(tenant: Tenant | None) -> store_pb2.RemoveNamespaceResponse:
            ns = self._ns(tenant, request.namespace)
            return store_pb2.RemoveNamespaceResponse(removed=self.store.remove_tree(ns))

        return self._run("remove_namespace", context, go)

    def Stats(
        self, request: store_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> store_pb2.StatsResponse:
        def go(tenant: Tenant | None) -> store_pb2.StatsResponse:
            return stats_message(self._stats(), store_pb2.StatsResponse, worker_id=self.worker_id)

        return self._run("stats", context, go)

    def HandOff(
        self, request: store_pb2.HandOffRequest, context: grpc.ServicerContext
    ) -> store_pb2.HandOffResponse:
        """Master.Drain's second step: hand the DRAM blocks to their next owners
        (kvstore.worker.handoff). Admin tenants only, when there are tenants."""

        def go(tenant: Tenant | None) -> store_pb2.HandOffResponse:
            if tenant is not None and not tenant.admin:
                raise PermissionDenied(f"tenant {tenant.name!r} may not drain a worker")
            if self.hand_off is None:
                raise Unavailable("this worker cannot hand off its blocks")
            if not 0 <= request.timeout_s <= 3600:
                raise InvalidArgument(f"timeout_s {request.timeout_s:g} is not within 0..3600")
            r = self.hand_off(request.timeout_s)
            return store_pb2.HandOffResponse(
                moved_blocks=r.moved_blocks,
                moved_bytes=r.moved_bytes,
                kept_blocks=r.kept_blocks,
                seconds=r.seconds,
            )

        return self._run("hand_off", context, go)

    def SessionHint(
        self, request: store_pb2.SessionHintRequest, context: grpc.ServicerContext
    ) -> store_pb2.SessionHintResponse:
        def go(tenant: Tenant | None) -> store_pb2.SessionHintResponse:
            ns, keys = self._keys(tenant, request.namespace, request.hashes)
            ttl = request.ttl_seconds if request.ttl_seconds > 0 else None
            if request.ttl_seconds < 0:
                raise InvalidArgument(
                    f"ttl_seconds must not be negative, got {request.ttl_seconds}"
                )
            depths, cuts = session_cuts(ns, request, len(keys))
            # The client whose session it is (kvstore.worker.sessions): its cut notices
            # are applied and handed to it alone.
            client = client_identity(context.invocation_metadata())
            got = self.store.session_hint(
                ns,
                request.session_id,
                request.state,
                keys,
                ttl,
                depths,
                cuts,
                client=client,
                whole=request.whole,
            )
            metrics.observe_session_hit_ratios(self.store.take_closed_rates())
            out = [
                store_pb2.SessionCut(namespace=request.namespace, session_id=n, depth=d, turn=t)
                for n, d, t in self.store.take_cuts(ns, client)
            ]
            return store_pb2.SessionHintResponse(matched=got.matched, cuts=out, resend=got.resend)

        return self._run("session_hint", context, go)

    def Sessions(
        self, request: store_pb2.SessionsRequest, context: grpc.ServicerContext
    ) -> store_pb2.SessionsResponse:
        def go(tenant: Tenant | None) -> store_pb2.SessionsResponse:
            owns = tenant.owns if tenant is not None else None
            limit = min(request.limit or 10, 1000)
            view = self.store.sessions_report(owns, limit, time.monotonic())
            return store_pb2.SessionsResponse(
                worker_id=self.worker_id,
                sessions=[
                    store_pb2.SessionInfo(
                        namespace=s.ns,
                        session_id=s.name,
                        state=s.state,
                        blocks=s.blocks,
                        hit_blocks=s.hit_blocks,
                        lookup_blocks=s.lookup_blocks,
                        expires_in_seconds=s.expires_in,
                    )
                    for s in view.sessions
                ],
                live=view.live,
                dropped=view.dropped,
                expired=view.expired,
                retained_bytes=view.retained_bytes,
                retain_budget_bytes=view.retain_budget,
                prefetched=view.prefetched,
                blocks_refused=view.blocks_refused,
                cuts_refused=view.cuts_refused,
                hints_refused=view.hints_refused,
                moved=view.moved,
                restarted=view.restarted,
            )

        return self._run("sessions", context, go)


def _name(tenant: Tenant | None) -> str:
    return tenant.name if tenant is not None else ""


MAX_CUTS = 4096  # cut notices one hint may carry


def session_cuts(
    ns: str, request: store_pb2.SessionHintRequest, n_keys: int
) -> tuple[list[int], list[tuple[str, int, int]]]:
    """A hint's depths (none, or one per hash) and the cut notices it carries (every
    one of the hint's namespace, with a valid session id), else InvalidArgument."""
    depths = list(request.depths)
    if depths and len(depths) != n_keys:
        raise InvalidArgument(f"{len(depths)} depths for {n_keys} hashes")
    if len(request.cuts) > MAX_CUTS:
        raise InvalidArgument(f"a hint carries at most {MAX_CUTS} cuts, got {len(request.cuts)}")
    cuts: list[tuple[str, int, int]] = []
    for c in request.cuts:
        if c.namespace != request.namespace:
            raise InvalidArgument(
                f"a cut of namespace {c.namespace!r} in a hint of {request.namespace!r}"
            )
        check_hint(c.session_id, "paused", None)
        cuts.append((c.session_id, c.depth, c.turn))
    return depths, cuts
