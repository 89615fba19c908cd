"""The daemons' view of the one error hierarchy (defined in kvstore_client.errors).

Servicers call :func:`abort` to turn any exception into the gRPC status of the
one mapping table, so every daemon reports the same codes for the same faults.
"""

from __future__ import annotations

import logging
from typing import NoReturn

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
