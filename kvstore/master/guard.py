"""Tenant checks for the Master service, as one gRPC server interceptor.

With a tenants file, every Master call needs a known bearer token
(UNAUTHENTICATED otherwise); membership writes (Register, Heartbeat, HeartbeatStream,
Beats, Leave) and ClusterStatus (every worker's endpoints and stats, which tell one
tenant about the others' use) need an admin tenant's (PERMISSION_DENIED otherwise).
The shard map stays readable by every tenant: clients route with it. Health checks
stay open for probes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from kvstore_client.errors import KVStoreError, to_grpc_code

from ..auth import Tenants, bearer

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the stubs are generic, the runtime class is not
    Handler = grpc.RpcMethodHandler
SERVICE = "/kvstore.v1.Master/"
ADMIN_ONLY = frozenset({"Register", "Heartbeat", "HeartbeatStream", "Beats", "Leave", "Drain"})
ADMIN_READS = frozenset({"ClusterStatus"})
STREAMING = frozenset({"WatchShardMap", "HeartbeatStream", "Beats"})  # streamed answers
STREAMED_REQUESTS = frozenset({"HeartbeatStream", "Beats"})


def _denied(code: grpc.StatusCode, message: str, name: str) -> Handler:
    """A handler that refuses the call ``name`` with ``code`` (its shape matches
    the method's: unary or streamed requests and answers)."""
    streaming = name in STREAMING

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if name in STREAMED_REQUESTS:
        return grpc.stream_stream_rpc_method_handler(stream)
    if streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class TenantGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        method = details.method or ""
        if not method.startswith(SERVICE):
            return await continuation(details)
        name = method[len(SERVICE) :]
        try:
            tenant = self.tenants.authenticate(bearer(details.invocation_metadata))
        except KVStoreError as e:
            return _denied(to_grpc_code(e), str(e), name)
        if name in ADMIN_ONLY and not tenant.admin:
            msg = f"tenant {tenant.name!r} may not change cluster membership"
            return _denied(grpc.StatusCode.PERMISSION_DENIED, msg, name)
        if name in ADMIN_READS and not tenant.admin:
            msg = f"{name} needs an admin tenant's token; tenant {tenant.name!r} is not admin"
            return _denied(grpc.StatusCode.PERMISSION_DENIED, msg, name)
        return await continuation(details)
