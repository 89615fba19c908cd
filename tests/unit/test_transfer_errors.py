"""The error tree's middle layer (caller's fault vs peer's fault), the one mapping of
transport failures into it, and the one place a worker's transport is picked."""

from __future__ import annotations

import asyncio

import pytest

from kvstore_client import errors as E
from kvstore_client.proto import master_pb2
from kvstore_client.routing import pick_transfer
from kvstore_client.transport.tcp import TcpPool, TcpTransfer
from kvstore_client.transport.ucx import UcxPool


@pytest.mark.parametrize(
    "cls", [E.InvalidArgument, E.PermissionDenied, E.Unauthenticated, E.NotFound]
)
def test_caller_faults(cls: type[E.KVStoreError]) -> None:
    assert issubclass(cls, E.CallerError) and not issubclass(cls, E.PeerError)


@pytest.mark.parametrize(
    "cls",
    [
        E.Unavailable,
        E.DeadlineExceeded,
        E.ResourceExhausted,
        E.QuotaExceeded,
        E.Internal,
        E.ProtocolError,
    ],
)
def test_peer_faults(cls: type[E.KVStoreError]) -> None:
    assert issubclass(cls, E.PeerError) and not issubclass(cls, E.CallerError)


def test_existing_bases_still_hold() -> None:
    assert issubclass(E.InvalidArgument, ValueError)
    assert issubclass(E.DeadlineExceeded, TimeoutError)
    assert issubclass(E.NotFound, KeyError)
    assert all(issubclass(c, E.KVStoreError) for c in (E.CallerError, E.PeerError))


def test_transport_errors_map_in_one_place() -> None:
    where = "tcp://h:1"
    got = E.from_transport_error(E.ProtocolError("bad magic"), where)
    assert isinstance(got, E.Unavailable) and "bad magic" in str(got)
    assert isinstance(E.from_transport_error(TimeoutError(), where), E.DeadlineExceeded)
    assert isinstance(E.from_transport_error(ConnectionResetError(), where), E.Unavailable)
    assert isinstance(E.from_transport_error(RuntimeError("ucx"), where), E.Unavailable)
    answered = E.PermissionDenied("not yours")
    assert E.from_transport_error(answered, where) is answered
    cancelled = asyncio.CancelledError()
    assert E.from_transport_error(cancelled, where) is cancelled


def test_transport_picked_by_scheme() -> None:
    info = master_pb2.WorkerInfo(id="w", endpoints=["tcp://127.0.0.1:1", "ucx://127.0.0.1:2"])
    pool = TcpPool("127.0.0.1", 1)
    try:
        assert isinstance(pick_transfer(info, pool, {}), TcpTransfer)
        ucx = UcxPool("127.0.0.1", 2)
        assert pick_transfer(info, pool, {"ucx": ucx}) is ucx
    finally:
        pool.close()
