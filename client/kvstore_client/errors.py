"""One exception tree for kvstore, and the one table that maps it to gRPC codes.

Both sides use it: the daemons raise these and a servicer turns them into a gRPC
status with :func:`to_grpc_code`; the client turns a gRPC status (or a transfer
frame's error code) back into the same class with :func:`from_code`.
"""

from __future__ import annotations

import enum

import grpc


class Code(enum.IntEnum):
    """Error codes carried on the transfer plane; values mirror grpc.StatusCode."""

    OK = 0
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INVALID_ARGUMENT = 3
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    code: Code = Code.INTERNAL


class CallerError(KVStoreError):
    """The caller's fault (bad input, no permission, bad credentials, no such key):
    retrying the same call elsewhere will not help. Batch calls raise these."""


class PeerError(KVStoreError):
    """The peer's fault or state (down, too slow, full, broken frames, a bug there):
    another worker or a later try may succeed. Batch calls turn these into misses."""


class InvalidArgument(CallerError, ValueError):
    """Malformed request: bad hash length, value over the size limit, bad namespace."""

    code = Code.INVALID_ARGUMENT


class NotFound(CallerError, KeyError):
    """A single-key call found nothing (batch calls report misses in their result)."""

    code = Code.NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "not found"


class ResourceExhausted(PeerError):
    """A tier is full and nothing could be evicted, or a quota is used up."""

    code = Code.RESOURCE_EXHAUSTED


class QuotaExceeded(ResourceExhausted):
    """A pinned namespace or a tenant is over its byte quota."""


class SessionShareFull(ResourceExhausted):
    """A hinted session already holds its share of a worker's tiers: its deeper blocks
    are not admitted. Puts report them as not stored; they never raise it."""


class PermissionDenied(CallerError):
    """The caller may not touch this namespace."""

    code = Code.PERMISSION_DENIED


class Unauthenticated(CallerError):
    """Missing or wrong credentials."""

    code = Code.UNAUTHENTICATED


class Unavailable(PeerError):
    """Worker draining, master not the leader, peer down: try another or later."""

    code = Code.UNAVAILABLE


class DeadlineExceeded(PeerError, TimeoutError):
    """A call ran past its deadline."""

    code = Code.DEADLINE_EXCEEDED


class ProtocolError(PeerError):
    """A transfer frame broke the protocol; the connection is closed."""

    code = Code.INVALID_ARGUMENT


class Internal(PeerError):
    """A bug or an unexpected failure inside a daemon."""

    code = Code.INTERNAL


_BY_CODE: dict[Code, type[KVStoreError]] = {
    Code.INVALID_ARGUMENT: InvalidArgument,
    Code.NOT_FOUND: NotFound,
    Code.RESOURCE_EXHAUSTED: ResourceExhausted,
    Code.PERMISSION_DENIED: PermissionDenied,
    Code.UNAUTHENTICATED: Unauthenticated,
    Code.UNAVAILABLE: Unavailable,
    Code.DEADLINE_EXCEEDED: DeadlineExceeded,
    Code.FAILED_PRECONDITION: Unavailable,
    Code.INTERNAL: Internal,
}


def to_grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception (INTERNAL for anything unexpected)."""
    code = exc.code if isinstance(exc, KVStoreError) else Code.INTERNAL
    for status in grpc.StatusCode:
        if status.value[0] == int(code):
            return status
    return grpc.StatusCode.INTERNAL


def from_code(code: int, message: str) -> KVStoreError:
    """The exception for a numeric code (a transfer frame's or gRPC's)."""
    try:
        cls = _BY_CODE[Code(code)]
    except ValueError:
        cls = Internal
    return cls(message)


def from_rpc_error(err: grpc.RpcError) -> KVStoreError:
    """Translate a failed gRPC call into the kvstore exception tree."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(details or "deadline exceeded")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(details or "unavailable")
    return from_code(code.value[0], details or code.name)


def from_transport_error(exc: BaseException, where: str) -> BaseException:
    """The one place a transfer call's low-level failure is mapped into this tree.

    A broken frame from the peer -> Unavailable; a socket timeout -> DeadlineExceeded;
    any other OSError (refused, reset, closed) or UCX error -> Unavailable. Errors the
    peer answered (already KVStoreError) are returned as they are, and so is anything
    that is not an Exception (cancellation, KeyboardInterrupt).
    """
    if isinstance(exc, ProtocolError):
        return Unavailable(f"{where}: {exc}")
    if isinstance(exc, KVStoreError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded(f"{where} did not answer in time")
    return Unavailable(f"{where}: {exc!r}" if not isinstance(exc, OSError) else f"{where}: {exc}")
