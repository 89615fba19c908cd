"""The daemons' view of the one error hierarchy (defined in kvstore_client.errors).

Servicers call :func:`abort` to turn any exception into the gRPC status of the
one mapping table, so every daemon reports the same codes for the same faults.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from kvstore_client.errors import (
    Code,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    to_grpc_code,
)

log = logging.getLogger(__name__)

__all__ = [
    "Code",
    "DeadlineExceeded",
    "Internal",
    "InvalidArgument",
    "KVStoreError",
    "NotFound",
    "PermissionDenied",
    "ProtocolError",
    "RejectUndecodable",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "abort",
    "to_grpc_code",
]


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status that the mapping table gives ``exc``."""
    if not isinstance(exc, KVStoreError):
        log.exception("unexpected error in a servicer", exc_info=exc)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    context.abort(to_grpc_code(exc), str(exc))
    raise AssertionError("unreachable")  # context.abort raises


class _Undecodable:
    """Stands in for a request whose bytes are not a valid protobuf message."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class RejectUndecodable(grpc.ServerInterceptor):  # type: ignore[misc,type-arg]
    """Answer INVALID_ARGUMENT to a unary request that does not decode.

    grpc itself answers INTERNAL ("Exception deserializing request!") and logs a
    traceback per request; a malformed request is the caller's fault, not ours.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        behavior = handler.unary_unary

        def safe_decode(raw: bytes) -> Any:
            try:
                return decode(raw)
            except Exception as e:  # DecodeError, bad UTF-8 in a string field ...
                return _Undecodable(str(e))

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.why}")
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=safe_decode,
            response_serializer=handler.response_serializer,
        )
